"""A failure that belongs to one request fails that request alone: its neighbours in the running batch
finish exactly as transformers would, and the server stays healthy.

A fault is injected into one request's setup (its sampler row, or its stop tracker and detokenizer)
while others run beside it, on the paged step and on padded batches.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration import reference
from tests.integration.harness import ServerThread, wait_until
from tgis.engine_loop import outputs as outputs_module
from tgis.engine_loop.sampled_rows import SampledRows
from tgis.pb import generation_pb2 as pb

POISON = "Poisoned request"
PROMPTS = ["Hello world", "The quick brown fox jumps over", POISON, "A longer prompt about the lazy dog"]
NEW_TOKENS = 12


def _faulty_sampler_row(monkeypatch: pytest.MonkeyPatch) -> None:
    real = SampledRows.add

    def add(self: SampledRows, task) -> None:
        if task.input.text == POISON:
            raise RuntimeError("injected: sampler row")
        real(self, task)

    monkeypatch.setattr(SampledRows, "add", add)


def _faulty_stop_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    real = outputs_module.for_tokenizer

    def for_tokenizer(tokenizer, input_ids, **kwargs):
        if tuple(input_ids) == tuple(tokenizer(POISON)["input_ids"]):
            raise RuntimeError("injected: stop tracker")
        return real(tokenizer, input_ids, **kwargs)

    monkeypatch.setattr(outputs_module, "for_tokenizer", for_tokenizer)


FAULTS = {"sampler-row": _faulty_sampler_row, "stop-tracker": _faulty_stop_tracker}


def _stream(server: ServerThread, text: str) -> str | grpc.RpcError:
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS))
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=params)
    try:
        return "".join(message.text for message in server.stub.GenerateStream(request, timeout=60))
    except grpc.RpcError as error:
        return error


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "padded"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_in_one_requests_setup_fails_it_alone(model_dirs, monkeypatch, paged, fault) -> None:
    FAULTS[fault](monkeypatch)
    server = ServerThread(model_dirs("llama"), paged_attention=paged, max_batch_size=8)
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = dict(zip(PROMPTS, pool.map(lambda text: _stream(server, text), PROMPTS), strict=True))
        failed = answers.pop(POISON)
        assert isinstance(failed, grpc.RpcError)
        assert failed.code() == grpc.StatusCode.UNKNOWN
        assert failed.details().startswith("Request failed during generation: injected:")
        for prompt, text in answers.items():
            assert text == reference.greedy(model_dirs("llama"), prompt, NEW_TOKENS).text, prompt
        assert server.http_ok() and server.loop.alive
        wait_until(lambda: server.loop.admitted_count == 0, "every request leaves the batch")
    finally:
        server.stop()
