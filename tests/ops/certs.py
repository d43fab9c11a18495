"""Certificates minted at test time: CAs, a localhost server certificate and client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
        cert_path.write_bytes(self.cert_pem)
        key_path.write_bytes(self.key_pem)
        return cert_path, key_path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sign(
    builder: x509.CertificateBuilder, key: ec.EllipticCurvePrivateKey, issuer: KeyPair | None
) -> KeyPair:
    now = datetime.datetime.now(datetime.UTC)
    builder = builder.serial_number(x509.random_serial_number()).public_key(key.public_key())
    builder = builder.not_valid_before(now - datetime.timedelta(minutes=5))
    builder = builder.not_valid_after(now + datetime.timedelta(days=1))
    signer = key if issuer is None else issuer.key
    cert = builder.sign(signer, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), key_pem, key, cert)


def make_ca(common_name: str) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    return _sign(builder, key, None)


def make_leaf(ca: KeyPair, common_name: str, *, server: bool) -> KeyPair:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.cert.subject)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _sign(builder, key, ca)


@dataclass(frozen=True)
class Pki:
    ca: KeyPair
    server_cert: Path
    server_key: Path
    ca_cert: Path
    client: KeyPair
    foreign_client: KeyPair


def make_pki(directory: Path) -> Pki:
    """A CA with a localhost server certificate and a client certificate, and a stranger's client."""
    ca = make_ca("tgis test CA")
    server_cert, server_key = make_leaf(ca, "localhost", server=True).write(directory, "server")
    ca_cert = directory / "ca.crt"
    ca_cert.write_bytes(ca.cert_pem)
    foreign_ca = make_ca("somebody else's CA")
    return Pki(
        ca=ca,
        server_cert=server_cert,
        server_key=server_key,
        ca_cert=ca_cert,
        client=make_leaf(ca, "a client", server=False),
        foreign_client=make_leaf(foreign_ca, "a stranger", server=False),
    )
