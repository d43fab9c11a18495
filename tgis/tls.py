"""TLS / mTLS: the PEM files, read once at startup, and their credentials for gRPC and HTTP (SPEC §12)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from tgis.config import Settings, StartupError

PEM_MARKER = b"-----BEGIN "


@dataclass(frozen=True)
class TlsFiles:
    """The server's key pair and, for mutual TLS, the CA that client certificates must chain to."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        # A client CA means client certificates are required, not merely requested.
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.client_ca, require_client_auth=self.mutual
        )


def load_tls(settings: Settings) -> TlsFiles | None:
    """None for plaintext; the files for TLS; StartupError with TGIS's message when misconfigured."""
    cert_path, key_path = settings.tls_cert_path, settings.tls_key_path
    ca_path = settings.tls_client_ca_cert_path
    if bool(cert_path) != bool(key_path):
        given, missing = ("TLS_CERT_PATH", "TLS_KEY_PATH") if cert_path else ("TLS_KEY_PATH", "TLS_CERT_PATH")
        raise StartupError(f"tls: must provide both cert and key ({given} is set, {missing} is not)")
    if not cert_path or not key_path:
        if ca_path:
            raise StartupError("tls: cannot provide client ca cert without keypair")
        return None
    return TlsFiles(
        cert=_read_pem("cert", cert_path),
        key=_read_pem("key", key_path),
        client_ca=_read_pem("client ca cert", ca_path) if ca_path else None,
    )


def _read_pem(what: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(f"couldn't load {what} from {path}") from exc
    # grpc only notices a bad file when the port is bound, with an opaque error; say which file now.
    if PEM_MARKER not in data:
        raise StartupError(f"couldn't load {what} from {path}")
    return data


def http_ssl_context(settings: Settings, tls: TlsFiles) -> ssl.SSLContext:
    """The gRPC side's key pair (and client CA, for mutual TLS) as an ssl context for aiohttp.

    With a client CA, a certificate a client presents must chain to it or the handshake fails; one that
    presents none is let through the handshake (CERT_OPTIONAL) so that /health stays reachable for probes,
    and its generation requests are refused by the HTTP guard, which logs and counts them (a refused
    handshake could be neither)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    assert settings.tls_cert_path and settings.tls_key_path
    context.load_cert_chain(settings.tls_cert_path, settings.tls_key_path)
    if tls.client_ca is not None:
        context.load_verify_locations(cadata=tls.client_ca.decode())
        context.verify_mode = ssl.CERT_OPTIONAL
    return context
