"""TLS and mutual TLS on the gRPC port (SPEC §12), and on HTTP with HTTP_TLS; certificates minted here."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.ops.certs import Pki
from tests.ops.serving import OpsServer
from tgis.config import Settings, StartupError
from tgis.pb import generation_pb2 as pb
from tgis.tls import load_tls

REFUSAL_TIMEOUT_SECONDS = 10


@pytest.fixture(scope="module")
def tls_server(pki: Pki, model_dirs) -> Iterator[OpsServer]:
    with OpsServer(
        model_dirs("gpt2"), tls_cert_path=str(pki.server_cert), tls_key_path=str(pki.server_key)
    ) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, model_dirs) -> Iterator[OpsServer]:
    with OpsServer(
        model_dirs("gpt2"),
        tls_cert_path=str(pki.server_cert),
        tls_key_path=str(pki.server_key),
        tls_client_ca_cert_path=str(pki.ca_cert),
    ) as server:
        yield server


def model_info(server: OpsServer, credentials: grpc.ChannelCredentials | None) -> pb.ModelInfoResponse:
    return server.stub(credentials).ModelInfo(pb.ModelInfoRequest(), timeout=REFUSAL_TIMEOUT_SECONDS)


def assert_refused(server: OpsServer, credentials: grpc.ChannelCredentials | None) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        model_info(server, credentials)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_client_is_served(tls_server: OpsServer, pki: Pki) -> None:
    info = model_info(tls_server, grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem))
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY


def test_plaintext_client_is_refused_by_a_tls_server(tls_server: OpsServer) -> None:
    assert_refused(tls_server, None)


def test_http_health_stays_plain_beside_tls(tls_server: OpsServer) -> None:
    status, _ = tls_server.http_get("/metrics")
    assert status == 200


def test_mtls_serves_a_client_signed_by_the_client_ca(mtls_server: OpsServer, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert_pem,
        private_key=pki.client.key_pem,
        certificate_chain=pki.client.cert_pem,
    )
    reply = mtls_server.stub(credentials).Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="hello")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2)),
        ),
        timeout=60,
    )
    assert reply.responses[0].generated_token_count == 2


def test_mtls_refuses_a_client_without_a_certificate(mtls_server: OpsServer, pki: Pki) -> None:
    assert_refused(mtls_server, grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_pem))


def test_mtls_refuses_a_client_certificate_from_another_ca(mtls_server: OpsServer, pki: Pki) -> None:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert_pem,
        private_key=pki.foreign_client.key_pem,
        certificate_chain=pki.foreign_client.cert_pem,
    )
    assert_refused(mtls_server, credentials)


def test_mtls_refuses_plaintext(mtls_server: OpsServer) -> None:
    assert_refused(mtls_server, None)


# ---------------------------------------------------------------- configuration errors (TGIS messages)


def test_cert_without_key_fails_with_the_tgis_message(pki: Pki) -> None:
    with pytest.raises(StartupError) as error:
        load_tls(Settings(tls_cert_path=str(pki.server_cert)))
    assert (
        str(error.value) == "tls: must provide both cert and key (TLS_CERT_PATH is set, TLS_KEY_PATH is not)"
    )


def test_key_without_cert_fails_with_the_tgis_message(pki: Pki) -> None:
    with pytest.raises(StartupError) as error:
        load_tls(Settings(tls_key_path=str(pki.server_key)))
    assert (
        str(error.value) == "tls: must provide both cert and key (TLS_KEY_PATH is set, TLS_CERT_PATH is not)"
    )


def test_client_ca_without_key_pair_fails_with_the_tgis_message(pki: Pki) -> None:
    with pytest.raises(StartupError, match=r"^tls: cannot provide client ca cert without keypair$"):
        load_tls(Settings(tls_client_ca_cert_path=str(pki.ca_cert)))


@pytest.mark.parametrize("which", ["cert", "key", "client ca cert"])
def test_unreadable_file_is_named_in_the_error(pki: Pki, tmp_path: Path, which: str) -> None:
    paths = {"cert": str(pki.server_cert), "key": str(pki.server_key), "client ca cert": str(pki.ca_cert)}
    paths[which] = str(tmp_path / "missing.pem")
    settings = Settings(
        tls_cert_path=paths["cert"],
        tls_key_path=paths["key"],
        tls_client_ca_cert_path=paths["client ca cert"],
    )
    with pytest.raises(StartupError) as caught:
        load_tls(settings)
    assert str(caught.value) == f"couldn't load {which} from {tmp_path / 'missing.pem'}"


def test_a_file_that_is_not_pem_is_refused_at_startup(pki: Pki, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    with pytest.raises(StartupError, match=f"^couldn't load cert from {garbage}$"):
        load_tls(Settings(tls_cert_path=str(garbage), tls_key_path=str(pki.server_key)))


def test_no_tls_settings_means_plaintext() -> None:
    assert load_tls(Settings()) is None


def test_http_tls_serves_the_http_port_with_the_same_certificates(pki: Pki, model_dirs) -> None:
    with OpsServer(
        model_dirs("gpt2"),
        tls_cert_path=str(pki.server_cert),
        tls_key_path=str(pki.server_key),
        http_tls=True,
    ) as server:
        context = ssl.create_default_context(cafile=str(pki.ca_cert))
        url = f"https://localhost:{server.server.http_port}"
        with urllib.request.urlopen(f"{url}/health", context=context, timeout=10) as response:
            assert response.status == 200
        body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
        post = urllib.request.Request(
            f"{url}/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(post, context=context, timeout=30) as response:
            assert "generated_text" in json.loads(response.read())
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext is refused
            urllib.request.urlopen(f"http://localhost:{server.server.http_port}/health", timeout=10)


def test_http_tls_without_certificates_fails_at_start(model_dirs) -> None:
    with (
        pytest.raises(StartupError, match="HTTP_TLS needs TLS_CERT_PATH and TLS_KEY_PATH"),
        OpsServer(model_dirs("gpt2"), http_tls=True),
    ):
        pass
