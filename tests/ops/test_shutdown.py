"""Graceful shutdown (SPEC §9.4): stop admitting, NOT_SERVING, in-flight calls finish within the grace."""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tests.integration.harness import wait_until
from tests.launcher import Launched, launcher_env
from tests.ops.serving import EngineFault, OpsServer, generate_request
from tgis import cli
from tgis.engine_loop.intake import Intake
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

IDLE_EXIT_SECONDS = 8  # what the TGIS integration harness allows an idle server


def stream_request(tokens: int) -> pb.SingleGenerationRequest:
    return pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text="The list"),
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=tokens, min_new_tokens=tokens)),
    )


class StreamReader(threading.Thread):
    """Reads a stream to its end in the background, keeping the messages or the error."""

    def __init__(self, stub: pb_grpc.GenerationServiceStub, request: pb.SingleGenerationRequest) -> None:
        super().__init__(daemon=True)
        self.responses = stub.GenerateStream(request, timeout=120)
        self.messages: list[pb.GenerationResponse] = []
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            for message in self.responses:
                self.messages.append(message)
        except grpc.RpcError as error:
            self.error = error


@pytest.fixture
def held(model_dirs) -> Iterator[tuple[OpsServer, EngineFault, threading.Event]]:
    """A server whose 3rd decode step waits for the returned event: a stream is reliably in flight."""
    server = OpsServer(model_dirs("gpt2"))
    fault = EngineFault(server.server.model.engine)
    gate = threading.Event()
    fault.on_decode = lambda step: gate.wait(60) if step == 3 else None
    yield server, fault, gate
    gate.set()
    fault.restore()
    server.stop()  # closes what the test left open; a server already stopped is not stopped again


def test_draining_refuses_new_calls_reports_not_serving_and_lets_a_stream_finish(held) -> None:
    server, fault, gate = held
    reader = StreamReader(server.stub(), stream_request(12))
    wait_until(lambda: fault.decodes >= 3, "the stream is held mid-generation")
    stopping = server.begin_stop(60)
    wait_until(lambda: server.server.drain.closed, "the server starts draining")

    assert server.grpc_health() == "NOT_SERVING"
    assert server.grpc_health("fmaas.GenerationService") == "NOT_SERVING"
    with pytest.raises(grpc.RpcError) as refused:
        server.stub().Generate(generate_request("late", 2), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == "Server is shutting down"
    assert not stopping.done()

    gate.set()
    stopping.result(60)
    reader.join(30)
    assert reader.error is None
    assert reader.messages[-1].stop_reason == pb.StopReason.MAX_TOKENS
    assert reader.messages[-1].generated_token_count == 12
    assert not server.server.engine_loop.alive


def test_calls_still_running_when_the_grace_ends_are_cancelled(held) -> None:
    server, fault, gate = held
    reader = StreamReader(server.stub(), stream_request(12))
    wait_until(lambda: fault.decodes >= 3, "the stream is held mid-generation")
    stopping = server.begin_stop(0.5)
    reader.join(30)  # the held stream is cut once the grace is over
    assert reader.error is not None
    assert reader.error.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    gate.set()  # lets the engine thread, still inside the held step, see that it must stop
    stopping.result(60)


# ---------------------------------------------------------------- the real process and SIGTERM


def test_sigterm_during_a_long_stream_lets_it_complete_and_exits_zero(
    launched: Callable[..., Launched], model_dirs, tmp_path: Path
) -> None:
    env = launcher_env(
        tmp_path / "termination-log", MODEL_NAME=str(model_dirs("gpt2")), SHUTDOWN_GRACE_SECONDS="100"
    )
    run = launched(env)
    stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(f"localhost:{run.wait_for_port('gRPC')}"))
    tokens = 240  # the tiny model's context is 256
    responses = stub.GenerateStream(stream_request(tokens), timeout=120)
    first = next(responses)  # the input-count message: the call is admitted and in flight
    assert first.input_token_count > 0
    run.process.send_signal(signal.SIGTERM)
    rest = list(responses)
    assert rest[-1].stop_reason == pb.StopReason.MAX_TOKENS
    assert rest[-1].generated_token_count == tokens
    assert run.process.wait(60) == 0, run.log()
    log = run.log()
    assert "Draining: waiting up to 100 s for 1 call(s) in flight" in log
    assert "Shutdown complete" in log
    assert "Traceback" not in log


def test_an_idle_server_exits_zero_soon_after_sigterm(
    launched: Callable[..., Launched], model_dirs, tmp_path: Path
) -> None:
    run = launched(launcher_env(tmp_path / "termination-log", MODEL_NAME=str(model_dirs("gpt2"))))
    run.wait_for_port("HTTP server")
    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(IDLE_EXIT_SECONDS) == 0, run.log()


def test_the_exit_after_guided_requests_is_clean_and_quiet(
    launched: Callable[..., Launched], model_dirs, tmp_path: Path
) -> None:
    """The startup heap is frozen out of garbage collection while serving, and thawed for the exit:
    xgrammar's bindings would report every grammar object still alive then as a leak."""
    run = launched(launcher_env(tmp_path / "termination-log", MODEL_NAME=str(model_dirs("gpt2"))))
    stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(f"localhost:{run.wait_for_port('gRPC')}"))
    params = pb.Parameters(
        decoding=pb.DecodingParameters(regex="[a-c]{3}x"), stopping=pb.StoppingCriteria(max_new_tokens=8)
    )
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="The list")], params=params)
    (response,) = stub.Generate(request, timeout=120).responses
    assert re.fullmatch("[a-c]{3}x", response.text), response.text
    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(IDLE_EXIT_SECONDS) == 0, run.log()
    log = run.log()
    assert "leaked" not in log and "nanobind" not in log, log[-2000:]


def test_a_crash_of_the_batching_loop_exits_non_zero_with_a_termination_message(
    monkeypatch: pytest.MonkeyPatch, model_dirs, tmp_path: Path
) -> None:
    def crash(self: Intake, busy: bool) -> bool:
        raise RuntimeError("scheduler exploded")

    monkeypatch.setattr(Intake, "wait_for_work", crash)
    monkeypatch.setattr(cli, "configure_logging", lambda *args, **kwargs: None)
    monkeypatch.setenv("TERMINATION_MESSAGE_PATH", str(tmp_path / "termination-log"))
    argv = ["--model-name", str(model_dirs("gpt2")), "--port", "0", "--grpc-port", "0"]
    code = cli.run_server(argv, "text-generation-launcher")
    assert code != 0
    assert (tmp_path / "termination-log").read_text() == "The batching loop crashed: scheduler exploded\n"
