"""The paged engine loop with a fabricated engine: what it schedules, what it emits, what it frees.

The engine here computes nothing: its logits make every sequence's next token its last token + 1,
and it records the step batches it was handed, so the tests can look at the loop's decisions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch

from engines.base import EngineSpec, LoraAdapter
from engines.step import KVCacheShape, StepBatch, StepOutput
from tgis.api.validation import ValidatedInput
from tgis.batching.blocks import BlockPool
from tgis.batching.paged import BlockWeights
from tgis.batching.scheduler import Scheduler
from tgis.loop import GenerationTask
from tgis.metrics import Metrics
from tgis.paged_loop import PagedEngineLoop
from tgis.sampling import SamplingConfig
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import FailureEvent, GenerationEvent, GenerationParams, StoppingParams, TokenEvent

VOCAB = 768
BLOCK = 4


class CountingEngine:
    """A paged engine whose next token is always the sequence's last token + 1."""

    def __init__(self) -> None:
        self.spec = EngineSpec(False, VOCAB, (), 0, torch.device("cpu"), torch.float32, paged=True)
        self.kv_shape = KVCacheShape(1, 1, 1, 4)
        self.steps: list[StepBatch] = []
        self.release = threading.Semaphore(1000)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        pass

    def step(self, batch: StepBatch) -> StepOutput:
        assert self.release.acquire(timeout=30)
        self.steps.append(batch)
        sampled = [chunk for chunk in batch.chunks if chunk.sample]
        logits = torch.full((len(sampled), VOCAB), -10.0)
        for row, chunk in enumerate(sampled):
            logits[row, (chunk.token_ids[-1] + 1) % VOCAB] = 10.0
        return StepOutput(logits, [None] * len(batch.chunks))

    def load_lora(self, adapter: LoraAdapter) -> None:
        pass

    def unload_lora(self, adapter_id: str) -> None:
        pass


class Request:
    """A submitted task and the events the loop sent it."""

    def __init__(self, ids: Sequence[int], new_tokens: int) -> None:
        self.events: list[GenerationEvent] = []
        self.done = threading.Event()
        params = GenerationParams(
            stopping=StoppingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        )
        validated = ValidatedInput(
            "",
            tuple(ids),
            params,
            seed=0,
            max_new_tokens=new_tokens,
            max_tokens_clamped=False,
            sampling=SamplingConfig.from_params(params, seed=0),
        )
        self.task = GenerationTask(validated, time.monotonic(), self._sink)

    def _sink(self, event: GenerationEvent) -> None:
        self.events.append(event)
        if isinstance(event, FailureEvent) or (
            isinstance(event, TokenEvent) and event.stop_reason.name != "NOT_FINISHED"
        ):
            self.done.set()

    def wait(self) -> None:
        assert self.done.wait(30), "the request never finished"

    @property
    def texts(self) -> list[str]:
        return [e.text for e in self.events if isinstance(e, TokenEvent)]

    @property
    def generated(self) -> int:
        return max((e.generated_token_count for e in self.events if isinstance(e, TokenEvent)), default=0)


@pytest.fixture
def make_loop(tokenizer):
    loops: list[PagedEngineLoop] = []

    def make(
        num_blocks: int = 64, max_step_tokens: int = 8, reserved: int = 0
    ) -> tuple[PagedEngineLoop, CountingEngine]:
        engine = CountingEngine()
        weights = BlockWeights(BLOCK, max_weight=num_blocks - reserved)
        loop = PagedEngineLoop(
            engine,
            Tokenizer(tokenizer),
            Scheduler(max_batch_size=8, max_waiting_tokens=4, weights=weights),
            Metrics(max_sequence_length=256, max_new_tokens=64, max_batch_size=8),
            BlockPool(num_blocks, BLOCK),
            max_step_tokens,
        )
        loop.start()
        loops.append(loop)
        return loop, engine

    yield make
    for loop in loops:
        loop.stop()


def test_a_long_prompt_is_chunked_under_the_step_budget_while_the_running_stream_decodes(make_loop):
    loop, engine = make_loop(max_step_tokens=8)
    running = Request(range(100, 104), new_tokens=12)
    engine.release = threading.Semaphore(3)  # let the first request start decoding, then hold steps
    loop.submit([running.task])
    time.sleep(0.2)
    long = Request(range(200, 230), new_tokens=3)  # 30 prompt tokens: at least 4 steps of 7
    loop.submit([long.task])
    engine.release.release(1000)
    running.wait()
    long.wait()
    assert all(step.num_tokens <= 8 for step in engine.steps)
    prompt_steps = [
        step for step in engine.steps if any(c.token_ids[0] >= 200 and c.start < 30 for c in step.prefill)
    ]
    assert len(prompt_steps) >= 4
    assert all(len(step.decode) == 1 for step in prompt_steps)  # the running stream got a token every step
    assert running.generated == 12 and long.generated == 3
    assert loop.planner.pool.usage().used == 0


class FixedPromptCap:
    """Stands in for PromptBudget: a fixed cap while anything decodes; records what the loop reports."""

    def __init__(self, cap: int) -> None:
        self.fixed = cap
        self.observed: list[int] = []

    def cap(self, decoding: int, prefilling: int) -> int | None:
        return self.fixed if decoding else None

    def observe(self, tokens: int, seconds: float) -> None:
        assert seconds >= 0
        self.observed.append(tokens)


def test_the_prompt_budget_caps_prompt_chunks_while_streams_decode_and_learns_from_every_step(make_loop):
    loop, engine = make_loop(max_step_tokens=64)
    budget = FixedPromptCap(5)
    loop.prompt_budget = budget  # type: ignore[assignment]
    running = Request(range(100, 104), new_tokens=12)
    engine.release = threading.Semaphore(3)
    loop.submit([running.task])
    time.sleep(0.2)
    long = Request(range(200, 230), new_tokens=3)  # 30 prompt tokens
    loop.submit([long.task])
    engine.release.release(1000)
    running.wait()
    long.wait()
    first = engine.steps[0]
    assert sum(len(c.token_ids) for c in first.prefill) == 4  # nothing decoding yet: no cap
    capped = [step for step in engine.steps if step.decode and step.prefill]
    assert len(capped) >= 6  # 30 prompt tokens, 5 at a time beside the decoding stream
    assert all(sum(len(c.token_ids) for c in step.prefill) <= 5 for step in capped)
    assert budget.observed == [step.num_tokens for step in engine.steps]
    assert running.generated == 12 and long.generated == 3


def test_admission_counts_blocks_at_every_point_in_time_and_never_runs_the_pool_dry(make_loop):
    # 9 blocks; a request holds up to 5 (10 prompt + 10 new positions). Two fit side by side when
    # one is far enough along (the granular check: it finishes before the other peaks); three never do.
    loop, engine = make_loop(num_blocks=9, max_step_tokens=64)
    requests = [Request(range(start, start + 10), 10) for start in (100, 300, 500)]
    loop.submit([request.task for request in requests])
    for request in requests:
        request.wait()
    assert all(request.generated == 10 for request in requests)
    assert not any(isinstance(e, FailureEvent) for request in requests for e in request.events)
    running_together = [len({c.token_ids[0] // 100 for c in step.chunks}) for step in engine.steps]
    assert max(running_together) == 2
    assert loop.planner.pool.usage().used == 0


def test_a_repeated_prompt_takes_its_cached_blocks_and_computes_only_the_rest(make_loop):
    loop, engine = make_loop()
    prompt = range(100, 113)  # 13 tokens: 3 full blocks may be cached, the last position is computed
    first = Request(prompt, 2)
    loop.submit([first.task])
    first.wait()
    steps_before = len(engine.steps)
    second = Request(prompt, 2)
    loop.submit([second.task])
    second.wait()
    second_prefill = [c for s in engine.steps[steps_before:] for c in s.prefill]
    assert second_prefill[0].start == 12 and second_prefill[0].token_ids == (112,)
    assert loop.metrics.prefix_cache_hits._value.get() == 12
    assert second.texts == first.texts and second.generated == first.generated == 2


def test_a_cancelled_request_frees_its_blocks_while_the_other_finishes(make_loop):
    loop, engine = make_loop(max_step_tokens=16)
    engine.release = threading.Semaphore(2)
    keep, cancel = Request(range(100, 105), 6), Request(range(300, 320), 30)
    loop.submit([keep.task, cancel.task])
    time.sleep(0.2)
    cancel.task.cancelled = True
    engine.release.release(1000)
    keep.wait()
    deadline = time.monotonic() + 10
    while loop.running_count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.running_count == 0
    assert loop.planner.pool.usage().used == 0
    assert keep.generated == 6 and not cancel.done.is_set()
