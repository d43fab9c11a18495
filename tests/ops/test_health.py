"""HTTP /health (generation-healthy flag, probe, 503 bodies) and grpc.health.v1 status (SPEC §11)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from tests.integration.harness import wait_until
from tests.ops.serving import EngineFault, OpsServer, generate_request
from tgis.pb import generation_pb2 as pb
from tgis.types import GenerationHealth

UNHEALTHY = b'{"error":"unhealthy"}'
TIMED_OUT = b'{"error":"Healthcheck timed-out"}'


@pytest.fixture
def server(model_dirs) -> Iterator[OpsServer]:
    with OpsServer(model_dirs("gpt2")) as running:
        yield running


@pytest.fixture
def fault(server: OpsServer) -> Iterator[EngineFault]:
    wrapper = EngineFault(server.server.model.engine)
    yield wrapper
    if wrapper.gate is not None:
        wrapper.gate.set()
    wrapper.restore()


def test_generation_flag_starts_false_and_the_first_probe_runs_a_real_generation(
    server: OpsServer, fault: EngineFault
) -> None:
    loop = server.server.engine_loop
    assert loop.generation_health == GenerationHealth.UNKNOWN and not loop.generation_healthy
    assert server.http_get("/health") == (200, b"")
    assert fault.prefills == 1
    assert loop.generation_healthy


def test_a_healthy_flag_makes_the_probe_only_check_the_device(server: OpsServer, fault: EngineFault) -> None:
    assert server.http_get("/health")[0] == 200
    assert server.http_get("/health")[0] == 200
    assert server.http_get("/health")[0] == 200
    assert fault.prefills == 1


def test_a_successful_request_sets_the_flag(server: OpsServer, fault: EngineFault) -> None:
    server.stub().Generate(generate_request("hi", 2), timeout=60)
    assert server.server.engine_loop.generation_healthy
    assert server.http_get("/health")[0] == 200
    assert fault.prefills == 1  # the request's prefill; the probe ran none


def test_the_probe_does_not_disturb_a_running_batch(server: OpsServer, fault: EngineFault) -> None:
    stub = server.stub()
    expected = stub.Generate(generate_request("The list", 40), timeout=60).responses[0].text
    loop = server.server.engine_loop
    probe_ids = server.server.health_checker.probe_ids if server.server.health_checker else []
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text="The list"),
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=40)),
    )
    prefills_before, decodes_before = fault.prefills, fault.decodes
    probes = []

    def probe_mid_stream(step: int) -> None:
        # Runs on the loop thread, inside a decode step: the probe runs before the next step.
        if step == decodes_before + 5:
            probes.append(loop.probe(probe_ids))

    fault.on_decode = probe_mid_stream
    text = "".join(message.text for message in stub.GenerateStream(request, timeout=60))
    assert len(probes) == 1 and isinstance(probes[0].result(timeout=30), int)
    assert fault.prefills == prefills_before + 2  # the stream's prefill and the probe's
    assert text == expected


def test_a_failed_forward_pass_gives_503_and_not_serving_until_generation_works_again(
    server: OpsServer, fault: EngineFault
) -> None:
    assert server.http_get("/health")[0] == 200
    assert server.grpc_health() == "SERVING"
    fault.failing = True
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().Generate(generate_request("hi", 2), timeout=60)
    assert "injected device failure" in (caught.value.details() or "")
    assert server.server.engine_loop.generation_health == GenerationHealth.FAILED
    wait_until(lambda: server.grpc_health() == "NOT_SERVING", "gRPC health reports NOT_SERVING")
    assert server.grpc_health("fmaas.GenerationService") == "NOT_SERVING"
    assert server.http_get("/health") == (503, UNHEALTHY)  # the probe's generation fails too
    fault.failing = False
    assert server.http_get("/health") == (200, b"")  # the probe's generation succeeds again
    wait_until(lambda: server.grpc_health() == "SERVING", "gRPC health reports SERVING again")


def test_a_probe_slower_than_the_timeout_gives_503_timed_out(server: OpsServer, fault: EngineFault) -> None:
    assert server.server.health_checker is not None
    server.server.health_checker.timeout = 0.3
    fault.gate = threading.Event()
    assert server.http_get("/health") == (503, TIMED_OUT)
    fault.gate.set()
    wait_until(lambda: server.server.engine_loop.generation_healthy, "the delayed probe finishes")
    server.server.health_checker.timeout = 60
    assert server.http_get("/health") == (200, b"")


def test_a_crashed_batching_loop_gives_503_and_not_serving(server: OpsServer, fault: EngineFault) -> None:
    class Fatal(BaseException):
        """What an engine raises when it can run no further step."""

    fault.fatal = Fatal("rank 1 died")
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().Generate(generate_request("hi", 2), timeout=60)
    assert "batching loop crashed" in (caught.value.details() or "")
    wait_until(lambda: server.server.fatal is not None, "the server records the crash")
    assert server.http_get("/health") == (503, UNHEALTHY)
    wait_until(lambda: server.grpc_health() == "NOT_SERVING", "gRPC health reports NOT_SERVING")
    with pytest.raises(grpc.RpcError) as again:  # later requests fail at once instead of hanging
        server.stub().Generate(generate_request("hi", 2), timeout=60)
    assert "not running" in (again.value.details() or "")


def test_serving_status_is_reported_for_both_service_names(server: OpsServer) -> None:
    assert server.grpc_health("") == "SERVING"
    assert server.grpc_health("fmaas.GenerationService") == "SERVING"
