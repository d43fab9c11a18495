"""Runtime behaviour that needs control over the engine: failures (SPEC §3.2), deadlines while queued and
the stop within one step (§5.6), tokenizer errors (§3.1 #14) and the tokenizer's EOS (§5.5); also a
prefix id sent to a server without a prefix store (§3.1 #13).

A test-only server runs the llama fixture with the suite's limits but, unlike the suite servers, no
PREFIX_STORE_PATH; `EngineControl` wraps its engine so a test can pace decode steps (each released by
the test, so no sleeps) and inject one-shot faults.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoConfig, GenerationConfig

import tgis.engine_loop.intake
from tests.conformance.conftest import SUITE_SETTINGS
from tests.conformance.expected import Effective, Prompt, expected_greedy
from tests.conformance.models import EOS_PROMPT, EOS_STEP
from tests.conformance.oracle import Reference
from tests.integration.harness import ServerThread, wait_until
from tgis.pb import generation_pb2 as pb

STEP_DEADLINE_SECONDS = 30.0


@dataclass
class EngineControl:
    """Wraps a live engine's prefill/decode: optional pacing and one-shot injected faults."""

    engine: Any
    paced: bool = False
    fail_decode: Exception | None = None
    fail_prefill: Exception | None = None
    decode_starts: list[float] = field(default_factory=list)
    _steps: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    def install(self) -> None:
        self._decode, self._prefill = self.engine.decode, self.engine.prefill
        self.engine.decode, self.engine.prefill = self._paced_decode, self._faulty_prefill

    def uninstall(self) -> None:
        self.engine.decode, self.engine.prefill = self._decode, self._prefill

    def _paced_decode(self, token_ids: Any) -> torch.Tensor:
        if self.paced and not self._steps.acquire(timeout=STEP_DEADLINE_SECONDS):
            raise RuntimeError("the test never released this step")
        self.decode_starts.append(time.monotonic())
        fault, self.fail_decode = self.fail_decode, None
        if fault is not None:
            raise fault
        return self._decode(token_ids)

    def _faulty_prefill(self, rows: Any) -> Any:
        fault, self.fail_prefill = self.fail_prefill, None
        if fault is not None:
            raise fault
        return self._prefill(rows)

    def step_until(self, predicate: Callable[[], bool], what: str) -> None:
        """Release decode steps one at a time until `predicate` holds."""

        def poll() -> bool:
            if predicate():
                return True
            self._steps.release()
            return False

        wait_until(poll, what)

    def unpace(self) -> None:
        self.paced = False
        for _ in range(1000):
            self._steps.release()


@pytest.fixture(scope="module")
def llama_ref(suite_refs: dict[str, Reference]) -> Reference:
    return suite_refs["llama"]


@pytest.fixture(scope="module")
def runtime_server(suite_models: dict[str, Path]) -> Iterator[ServerThread]:
    """The llama fixture with the suite's limits and no prefix store, on padded batches: these cases
    pace and fail its prefill/decode calls (the paged step's faults: tests/integration/test_paged.py)."""
    server = ServerThread(suite_models["llama"], paged_attention=False, **SUITE_SETTINGS)
    yield server
    server.stop()


@pytest.fixture
def control(runtime_server: ServerThread) -> Iterator[EngineControl]:
    control = EngineControl(runtime_server.engine)
    control.install()
    try:
        yield control
    finally:
        control.unpace()
        wait_until(lambda: runtime_server.loop.admitted_count == 0, "the test's requests are gone")
        control.uninstall()


def params(max_new_tokens: int, **extra: Any) -> pb.Parameters:
    stopping = pb.StoppingCriteria(
        max_new_tokens=max_new_tokens, time_limit_millis=extra.pop("time_limit", 0)
    )
    return pb.Parameters(stopping=stopping, response=pb.ResponseOptions(**extra))


def unary_request(text: str, p: pb.Parameters) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)], params=p)


class Stream(threading.Thread):
    """Consumes one GenerateStream call in the background; `messages` fill in as they arrive."""

    def __init__(self, server: ServerThread, text: str, p: pb.Parameters) -> None:
        super().__init__(daemon=True)
        request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=p)
        self.call = server.stub.GenerateStream(request, timeout=120)
        self.messages: list[pb.GenerationResponse] = []
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
        except grpc.RpcError as error:
            self.error = error

    @property
    def count(self) -> int:
        return max((m.generated_token_count for m in self.messages), default=0)

    def failure(self) -> tuple[grpc.StatusCode, str]:
        self.join(60)
        assert self.error is not None, f"the stream succeeded: {self.messages}"
        return self.error.code(), self.error.details()


def greedy_answer(ref: Reference, text: str, p: pb.Parameters) -> tuple[str, int, str]:
    effective = Effective.of(p)
    expected = expected_greedy(ref, Prompt.of(ref, text, effective), effective)
    return expected.text, expected.generated_token_count, expected.stop_reason


def test_decode_failure_fails_every_running_request_with_its_own_token_count(
    runtime_server: ServerThread, control: EngineControl, llama_ref: Reference
) -> None:
    control.paced = True
    p = params(100, generated_tokens=True)  # one message per token: the stream shows its count
    first = Stream(runtime_server, "Hello world", p)
    control.step_until(lambda: first.count >= 3, "the first stream has 3 tokens")
    second = Stream(runtime_server, "Once upon a time", p)
    control.step_until(lambda: second.count >= 1 and runtime_server.loop.admitted_count == 2, "both run")
    control.fail_decode = RuntimeError("injected fault")
    control.step_until(lambda: not first.is_alive() and not second.is_alive(), "both streams end")
    # Read once the streams ended: a token message may still be on its way when the fault is set, and
    # every token the server counted reaches the client before the stream's error status.
    counts = (first.count, second.count)
    assert counts[0] >= 3 and counts[1] >= 1, counts
    for stream, count in zip((first, second), counts, strict=True):
        assert stream.failure() == (
            grpc.StatusCode.UNKNOWN,
            f"Request failed during generation: Error after generating {count} tokens: injected fault",
        )
    control.unpace()
    again = runtime_server.stub.Generate(unary_request("Hello world", params(12)), timeout=60).responses[0]
    assert (again.text, again.generated_token_count, pb.StopReason.Name(again.stop_reason)) == greedy_answer(
        llama_ref, "Hello world", params(12)
    )


def test_out_of_memory_fails_the_whole_batch_with_gpu_out_of_memory(
    runtime_server: ServerThread, control: EngineControl
) -> None:
    control.paced = True
    p = params(100, generated_tokens=True)
    streams = [Stream(runtime_server, text, p) for text in ("Hello world", "Once upon a time")]
    control.step_until(lambda: all(s.count >= 1 for s in streams), "both streams have a token")
    control.fail_decode = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    control.step_until(lambda: not any(s.is_alive() for s in streams), "both streams end")
    for stream in streams:
        assert stream.failure() == (
            grpc.StatusCode.UNKNOWN,
            "Request failed during generation: GPU out of memory",
        )


def test_prefill_failure_fails_only_the_new_group(
    runtime_server: ServerThread, control: EngineControl, llama_ref: Reference
) -> None:
    control.paced = True
    running = Stream(runtime_server, "Hello world", params(20))
    control.step_until(lambda: runtime_server.loop.admitted_count == 1, "the first request runs")
    control.fail_prefill = RuntimeError("injected prefill fault")
    joining = runtime_server.stub.Generate.future(unary_request("Once upon a time", params(20)), timeout=60)
    control.step_until(joining.done, "the joining request fails")
    error = joining.exception()
    assert isinstance(error, grpc.RpcError)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.UNKNOWN,
        "Request failed during generation: injected prefill fault",
    )
    control.unpace()
    running.join(60)
    assert running.error is None
    final = running.messages[-1]
    text = "".join(m.text for m in running.messages[1:])
    assert (text, final.generated_token_count, pb.StopReason.Name(final.stop_reason)) == greedy_answer(
        llama_ref, "Hello world", params(20)
    )


def test_detokenization_failure_fails_only_that_request(
    runtime_server: ServerThread, control: EngineControl, llama_ref: Reference
) -> None:
    healthy_text, broken_text = "Hello world", "zebra quokka"
    sentinel = llama_ref.encode(broken_text)[-1]  # in the broken request's detokenizer context only
    healthy_ids = llama_ref.encode(healthy_text)
    expected = greedy_answer(llama_ref, healthy_text, params(20))
    assert sentinel not in healthy_ids and sentinel not in llama_ref.encode(healthy_text + expected[0])
    hf = runtime_server.server.model.tokenizer.hf
    real_decode = hf.decode

    def decode(ids: Any, *args: Any, **kwargs: Any) -> Any:
        if sentinel in list(ids):
            raise ValueError("invalid byte sequence")
        return real_decode(ids, *args, **kwargs)

    hf.decode = decode
    try:
        control.paced = True
        healthy = runtime_server.stub.Generate.future(unary_request(healthy_text, params(20)), timeout=60)
        control.step_until(lambda: runtime_server.loop.admitted_count == 1, "the healthy request runs")
        broken = runtime_server.stub.Generate.future(unary_request(broken_text, params(20)), timeout=60)
        control.step_until(broken.done, "the broken request fails")
        control.unpace()
        answer = healthy.result().responses[0]
    finally:
        del hf.decode
    error = broken.exception()
    assert isinstance(error, grpc.RpcError)
    assert (error.code(), error.details()) == (
        grpc.StatusCode.UNKNOWN,
        "Request failed during detokenization: Token decoding error: invalid byte sequence",
    )
    assert (answer.text, answer.generated_token_count, pb.StopReason.Name(answer.stop_reason)) == expected


def test_deadline_passing_while_queued_ends_with_zero_tokens(
    runtime_server: ServerThread, control: EngineControl
) -> None:
    control.paced = True
    fillers = [Stream(runtime_server, f"Filler number {i}", params(150)) for i in range(8)]
    control.step_until(lambda: runtime_server.loop.admitted_count == 8, "the batch is full")
    timed = params(20, time_limit=100, input_text=True, input_tokens=True)
    unary = runtime_server.stub.Generate.future(unary_request("Too late", timed), timeout=60)
    streamed = Stream(runtime_server, "Too late", timed)
    control.step_until(lambda: unary.done() and not streamed.is_alive(), "both time out in the queue")
    answer = unary.result().responses[0]
    assert answer.input_token_count > 0
    assert (answer.generated_token_count, answer.text, pb.StopReason.Name(answer.stop_reason)) == (
        0,
        "",
        "TIME_LIMIT",
    )
    assert not answer.input_tokens and not answer.tokens
    first, final = streamed.messages  # no input-token message: it never reached prefill
    assert (first.input_token_count, first.text) == (answer.input_token_count, "Too late")
    assert (final.generated_token_count, final.text, pb.StopReason.Name(final.stop_reason)) == (
        0,
        "",
        "TIME_LIMIT",
    )
    for filler in fillers:
        filler.call.cancel()


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_time_limited_run_stops_within_one_step_after_the_deadline(
    runtime_server: ServerThread, control: EngineControl, llama_ref: Reference, mode: str
) -> None:
    control.paced = True
    limit = 0.2
    p = params(169, time_limit=int(limit * 1000))
    sent = time.monotonic()
    if mode == "unary":
        call = runtime_server.stub.Generate.future(unary_request("Hello world", p), timeout=60)
        control.step_until(call.done, "the time-limited call ends")
        answer = call.result().responses[0]
        text, count, reason = answer.text, answer.generated_token_count, answer.stop_reason
    else:
        stream = Stream(runtime_server, "Hello world", p)
        control.step_until(lambda: not stream.is_alive(), "the time-limited stream ends")
        text = "".join(m.text for m in stream.messages[1:])
        count, reason = stream.messages[-1].generated_token_count, stream.messages[-1].stop_reason
    elapsed = time.monotonic() - sent
    assert pb.StopReason.Name(reason) == "TIME_LIMIT"
    assert elapsed >= limit
    assert 1 <= count < 169
    # The server's clock starts a little after `sent`; allow 50 ms of that before counting steps.
    late_steps = [t for t in control.decode_starts if t > sent + limit + 0.05]
    assert len(late_steps) <= 1, f"{len(late_steps)} decode steps started after the deadline"
    effective = Effective.of(p)
    prefix = llama_ref.generate(
        Prompt.of(llama_ref, "Hello world", effective).ids, count, effective.penalties
    )
    assert text == llama_ref.decode(prefix.token_ids).rstrip("\ufffd")


def test_tokenizer_error_is_invalid_argument(runtime_server: ServerThread) -> None:
    tokenizer = runtime_server.server.model.tokenizer
    real_encode = tokenizer.encode

    def encode(text: str, **kwargs: Any) -> Any:
        if text == "boom":
            raise ValueError("cannot tokenize this")
        return real_encode(text, **kwargs)

    tokenizer.encode = encode  # type: ignore[method-assign]
    try:
        for call, request in (
            (runtime_server.stub.Generate, unary_request("boom", params(5))),
            (
                runtime_server.stub.GenerateStream,
                pb.SingleGenerationRequest(request=pb.GenerationRequest(text="boom")),
            ),
        ):
            with pytest.raises(grpc.RpcError) as error:
                result = call(request, timeout=30)
                if not isinstance(result, pb.BatchedGenerationResponse):
                    list(result)
            assert (error.value.code(), error.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "tokenizer error cannot tokenize this",
            )
        with pytest.raises(grpc.RpcError) as error:  # Tokenize: a tokenizer failure is UNKNOWN (SPEC §2.7)
            runtime_server.stub.Tokenize(
                pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text="boom")])
            )
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.UNKNOWN,
            "cannot tokenize this",
        )
    finally:
        del tokenizer.encode


def test_prefix_id_without_prefix_store(runtime_server: ServerThread) -> None:
    """§3.1 #13 / §8: without PREFIX_STORE_PATH any id gets the adapter's message, unary and streamed."""
    p = params(5)
    calls = (
        (runtime_server.stub.Generate, unary_request("Hello", p)),
        (
            runtime_server.stub.GenerateStream,
            pb.SingleGenerationRequest(request=pb.GenerationRequest(text="Hello"), params=p),
        ),
    )
    for call, request in calls:
        request.prefix_id = "invalid_prefix_id"
        with pytest.raises(grpc.RpcError) as error:
            result = call(request, timeout=30)
            if not isinstance(result, pb.BatchedGenerationResponse):
                list(result)
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "adapter_id supplied but no adapter store was configured",
        )


def test_full_internal_queue_is_resource_exhausted(
    runtime_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real bound (10 000) is impractical to fill.
    monkeypatch.setattr(tgis.engine_loop.intake, "MAX_QUEUE_SIZE", 0)
    with pytest.raises(grpc.RpcError) as error:
        runtime_server.stub.Generate(unary_request("Hello", params(5)), timeout=30)
    assert (error.value.code(), error.value.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "Server too busy",
    )


@pytest.mark.parametrize(
    ("model", "text"), [("llama_ties", "日本語のテキストと中文"), ("llama_eos", EOS_PROMPT)]
)
def test_special_tokens_rendered_but_never_a_trailing_eos(
    suite_models: dict[str, Path], model: str, text: str
) -> None:
    """With OUTPUT_SPECIAL_TOKENS, specials in the output are rendered (llama_ties greedily emits <pad>
    where its logits tie at 0), but the EOS that ends a request never is (llama_eos)."""
    ref = Reference.load(suite_models[model])
    generated = ref.generate(ref.encode(text), 30, Effective.of(None).penalties).token_ids
    body = generated[:-1] if generated[-1] == ref.eos_id else generated
    decoded = ref.tokenizer.decode(list(body), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    server = ServerThread(suite_models[model], output_special_tokens=True, **SUITE_SETTINGS)
    try:
        answer = server.stub.Generate(unary_request(text, params(30)), timeout=60).responses[0]
        streamed = list(
            server.stub.GenerateStream(
                pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=params(30)),
                timeout=60,
            )
        )
    finally:
        server.stop()
    assert answer.text == decoded.rstrip("\ufffd") == "".join(m.text for m in streamed[1:])
    assert answer.generated_token_count == len(generated)
    if model == "llama_ties":
        assert "<pad>" in answer.text
    else:
        assert pb.StopReason.Name(answer.stop_reason) == "EOS_TOKEN" and not answer.text.endswith("</s>")


def test_eos_comes_from_the_tokenizer_when_the_config_has_none(
    suite_models: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / "llama_eos_tokenizer_only"
    model_dir.mkdir()
    for path in suite_models["llama_eos"].iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    config = AutoConfig.from_pretrained(model_dir)
    config.eos_token_id = None
    config.save_pretrained(model_dir)
    GenerationConfig(pad_token_id=config.pad_token_id).save_pretrained(model_dir)
    server = ServerThread(model_dir, **SUITE_SETTINGS)
    try:
        answer = server.stub.Generate(unary_request(EOS_PROMPT, params(30)), timeout=60).responses[0]
    finally:
        server.stop()
    assert (pb.StopReason.Name(answer.stop_reason), answer.generated_token_count) == ("EOS_TOKEN", EOS_STEP)
