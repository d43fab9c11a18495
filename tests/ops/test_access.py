"""One guard for every door: with mutual TLS and an API key, no client generates over HTTP or gRPC
without the certificate and the key, on any route or port the server opens; probes still answer; each
refusal is logged with the client's address and counted."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.harness import wait_until
from tests.launcher import Launched, launcher_env
from tests.ops.certs import Pki
from tests.ops.serving import OpsServer
from tests.ops.test_metrics_scrape import parse
from tgis.config import Settings
from tgis.errors import StartupError
from tgis.http.layout import DEFAULT_TLS_GENERATION_PORT, GenerationPlace, http_layout
from tgis.pb import generation_pb2 as pb
from tgis.tls import TlsFiles

API_KEY = "sekrit"
# Every generation route of the HTTP APIs, with a body that would generate if let through.
ROUTES = [
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("POST", "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/generate_stream", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}),
    ("POST", "/tokenize", {"inputs": "Hello"}),
    ("GET", "/v1/models", None),
    ("GET", "/info", None),
]
GENERATED = ("generated_text", '"choices"', '"tokens"', '"data"')


@pytest.fixture(scope="module")
def guarded(pki: Pki, model_dirs) -> Iterator[OpsServer]:
    with OpsServer(
        model_dirs("gpt2"),
        tls_cert_path=str(pki.server_cert),
        tls_key_path=str(pki.server_key),
        tls_client_ca_cert_path=str(pki.ca_cert),
        api_key=API_KEY,
    ) as server:
        yield server


def tls_context(pki: Pki, *, client_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    if client_certificate:
        cert, key = pki.client.write(pki.ca_cert.parent, "client")
        context.load_cert_chain(cert, key)
    return context


def http_call(
    port: int,
    method: str,
    path: str,
    body: object,
    *,
    context: ssl.SSLContext | None = None,
    key: str | None = None,
) -> tuple[int, str]:
    """(status, body) of one request; status 0 when no HTTP answer came (refused handshake, not HTTP)."""
    connection = (
        http.client.HTTPConnection("localhost", port, timeout=30)
        if context is None
        else http.client.HTTPSConnection("localhost", port, timeout=30, context=context)
    )
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        connection.request(method, path, None if body is None else json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return 0, ""
    finally:
        connection.close()


def scrape_value(server: OpsServer, **labels: str) -> float:
    _, body = server.http_get("/metrics")
    return parse(body.decode()).samples.get(
        ("tgi_request_unauthorized_total", frozenset(labels.items())), 0.0
    )


# ---- HTTP ----------------------------------------------------------------------------------------------


def test_generation_has_its_own_tls_port_and_port_keeps_plaintext_probes(guarded: OpsServer) -> None:
    server = guarded.server
    assert server.http_generation_port not in (None, server.http_port, server.grpc_port)
    assert guarded.http_get("/health")[0] == 200
    assert guarded.http_get("/metrics")[0] == 200
    for method, path, body in ROUTES:  # PORT has no generation route at all
        status, _ = http_call(server.http_port, method, path, body, key=API_KEY)
        assert status in (404, 405), (path, status)


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[route[1] for route in ROUTES])
def test_no_client_certificate_no_tokens_on_any_route(
    guarded: OpsServer, pki: Pki, method, path, body
) -> None:
    port = guarded.server.http_generation_port
    assert port is not None
    refused_before = scrape_value(guarded, door="http", reason="client_certificate")
    status, text = http_call(
        port, method, path, body, context=tls_context(pki, client_certificate=False), key=API_KEY
    )
    assert status == 401, (status, text)
    assert "client certificate" in text
    assert not any(mark in text for mark in GENERATED), text
    assert http_call(port, method, path, body, key=API_KEY)[0] == 0  # plaintext: not even an HTTP answer
    assert scrape_value(guarded, door="http", reason="client_certificate") == refused_before + 1


def test_certificate_without_the_api_key_is_refused_logged_and_counted(
    guarded: OpsServer, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    port = guarded.server.http_generation_port
    assert port is not None
    before = scrape_value(guarded, door="http", reason="api_key")
    context = tls_context(pki, client_certificate=True)
    with caplog.at_level(logging.WARNING, logger="tgis.service.access"):
        status, text = http_call(port, "POST", "/generate", ROUTES[2][2], context=context, key="wrong")
    assert status == 401 and "generated_text" not in text
    assert scrape_value(guarded, door="http", reason="api_key") == before + 1
    assert any("Refused http POST /generate from 127.0.0.1" in message for message in caplog.messages)


def test_certificate_and_key_generate(guarded: OpsServer, pki: Pki) -> None:
    port = guarded.server.http_generation_port
    assert port is not None
    context = tls_context(pki, client_certificate=True)
    status, text = http_call(port, "POST", "/generate", ROUTES[2][2], context=context, key=API_KEY)
    assert status == 200, text
    assert "generated_text" in json.loads(text)
    assert (
        http_call(port, "GET", "/health", None, context=tls_context(pki, client_certificate=False))[0] == 200
    )


# ---- gRPC ----------------------------------------------------------------------------------------------


def client_credentials(pki: Pki) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pki.ca.cert_pem,
        private_key=pki.client.key_pem,
        certificate_chain=pki.client.cert_pem,
    )


def generate_request() -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="hello")],
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2)),
    )


def test_grpc_without_the_api_key_is_unauthenticated_on_every_method(
    guarded: OpsServer, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    stub = guarded.stub(client_credentials(pki))
    before = scrape_value(guarded, door="grpc", reason="api_key")
    calls = [
        lambda metadata: stub.Generate(generate_request(), metadata=metadata, timeout=30),
        lambda metadata: list(
            stub.GenerateStream(
                pb.SingleGenerationRequest(
                    request=pb.GenerationRequest(text="hi"), params=generate_request().params
                ),
                metadata=metadata,
                timeout=30,
            )
        ),
        lambda metadata: stub.Tokenize(
            pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text="hi")]), metadata=metadata, timeout=30
        ),
        lambda metadata: stub.ModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=30),
    ]
    with caplog.at_level(logging.WARNING, logger="tgis.service.access"):
        for call in calls:
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as caught:
                    call(metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert scrape_value(guarded, door="grpc", reason="api_key") == before + 2 * len(calls)
    assert any("Refused grpc /fmaas.GenerationService/Generate from ipv" in m for m in caplog.messages)


def test_grpc_with_the_api_key_generates_and_health_needs_none(guarded: OpsServer, pki: Pki) -> None:
    channel = guarded.channel(client_credentials(pki))
    reply = guarded.stub(client_credentials(pki)).Generate(
        generate_request(), metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=60
    )
    assert reply.responses[0].generated_token_count == 2
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


# ---- the switch and the layout -------------------------------------------------------------------------


def test_generation_routes_off_leave_tgis_surface(model_dirs) -> None:
    with OpsServer(model_dirs("gpt2"), http_generation_routes=False) as server:
        assert server.server.http_generation_port is None
        assert server.http_get("/health")[0] == 200
        assert server.http_get("/metrics")[0] == 200
        for method, path, body in ROUTES:
            assert http_call(server.server.http_port, method, path, body)[0] in (404, 405), path


TLS = TlsFiles(cert=b"c", key=b"k")


@pytest.mark.parametrize(
    ("settings", "tls", "place", "generation_port", "generation_tls"),
    [
        ({}, None, GenerationPlace.ON_PORT, None, False),
        ({"http_generation_port": 4000}, None, GenerationPlace.OWN_PORT, 4000, False),
        ({}, TLS, GenerationPlace.OWN_PORT, DEFAULT_TLS_GENERATION_PORT, True),
        ({"port": 0}, TLS, GenerationPlace.OWN_PORT, 0, True),
        ({"http_tls": True}, TLS, GenerationPlace.ON_PORT, None, False),
        ({"http_generation_routes": False}, TLS, GenerationPlace.OFF, None, False),
    ],
)
def test_http_layout(settings, tls, place, generation_port, generation_tls) -> None:
    layout = http_layout(Settings(**settings), tls)
    assert (layout.generation, layout.generation_port, layout.generation_tls) == (
        place,
        generation_port,
        generation_tls,
    )


def test_generation_cannot_share_a_plaintext_port_with_tls_configured() -> None:
    with pytest.raises(StartupError, match="HTTP_GENERATION_PORT 3000 is PORT, which serves plaintext"):
        http_layout(Settings(http_generation_port=3000), TLS)


# ---- the port scan -------------------------------------------------------------------------------------


def listening_ports(pid: int) -> set[int]:
    return {
        c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN
    }


def test_a_port_scan_of_the_launched_server_finds_no_open_door(pki: Pki, model_dirs) -> None:
    """The launcher as operators run it: every port it listens on, tried plaintext, over TLS without a
    client certificate, and over TLS with one but no key: none generates; PORT's /health answers."""
    env = launcher_env(
        MODEL_NAME=str(model_dirs("gpt2")),
        TLS_CERT_PATH=str(pki.server_cert),
        TLS_KEY_PATH=str(pki.server_key),
        TLS_CLIENT_CA_CERT_PATH=str(pki.ca_cert),
        API_KEY=API_KEY,
    )
    launched = Launched(env)
    try:
        grpc_port = launched.wait_for_port("gRPC server")
        http_port = launched.wait_for_port("HTTP server")
        generation_port = launched.wait_for_port("HTTP generation")
        wait_until(lambda: len(listening_ports(launched.process.pid)) >= 3, "the ports are open", 30)
        assert listening_ports(launched.process.pid) == {grpc_port, http_port, generation_port}, (
            launched.log()
        )
        assert http_call(http_port, "GET", "/health", None)[0] == 200
        attempts: list[dict[str, Any]] = [
            {"context": None, "key": API_KEY},
            {"context": tls_context(pki, client_certificate=False), "key": API_KEY},
            {"context": tls_context(pki, client_certificate=True), "key": None},
        ]
        for port in (grpc_port, http_port, generation_port):
            for method, path, body in ROUTES[:5]:
                for attempt in attempts:
                    status, text = http_call(port, method, path, body, **attempt)
                    assert status != 200 and "generated_text" not in text and "choices" not in text, (
                        port,
                        path,
                        status,
                    )
            with socket.create_connection(("localhost", port), timeout=10):
                pass  # open, as listed
    finally:
        launched.kill()
