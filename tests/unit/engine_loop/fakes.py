"""Fabricated parts for driving the engine loop without a model: tasks that record their events, a
paged engine that counts, and a scripted batch runner."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engines.base import EngineSpec, LoraAdapter
from engines.step import KVCacheShape, StepBatch, StepOutput
from tgis.batching.admission import Selection
from tgis.engine_loop.results import BatchUsage, RowFailure, SampledToken, StepResult, StepStats
from tgis.engine_loop.tasks import GenerationTask
from tgis.sampling import SamplingConfig
from tgis.service.validation import ValidatedInput
from tgis.types import FailureEvent, GenerationEvent, GenerationParams, StoppingParams, TokenEvent

VOCAB = 768
WAIT_SECONDS = 30.0


def spec(paged: bool = True) -> EngineSpec:
    return EngineSpec(False, VOCAB, (), 0, torch.device("cpu"), torch.float32, paged=paged)


class Recorder:
    """A task whose events are kept; `done` is set by its last event (final token or failure)."""

    def __init__(
        self,
        ids: Iterable[int],
        new_tokens: int,
        *,
        params: GenerationParams | None = None,
        guide: object | None = None,
        streamed: bool = True,
    ) -> None:
        self.events: list[GenerationEvent] = []
        self.done = threading.Event()
        params = params or GenerationParams(
            stopping=StoppingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        )
        validated = ValidatedInput(
            "",
            tuple(ids),
            params,
            seed=0,
            max_new_tokens=new_tokens,
            max_tokens_clamped=False,
            sampling=SamplingConfig.from_params(params, seed=0, guide=guide),
        )
        self.task = GenerationTask(validated, 0.0, self._sink, streamed=streamed)

    @property
    def id(self) -> int:
        return self.task.id

    def _sink(self, event: GenerationEvent) -> None:
        self.events.append(event)
        if isinstance(event, FailureEvent) or (isinstance(event, TokenEvent) and event.finished):
            self.done.set()

    def wait(self) -> None:
        assert self.done.wait(WAIT_SECONDS), "the request never finished"

    @property
    def failure(self) -> str | None:
        failures = [e.message for e in self.events if isinstance(e, FailureEvent)]
        return failures[-1] if failures else None

    @property
    def generated(self) -> int:
        return max((e.generated_token_count for e in self.events if isinstance(e, TokenEvent)), default=0)

    @property
    def stop_reason(self) -> str | None:
        finals = [e for e in self.events if isinstance(e, TokenEvent) and e.finished]
        return finals[-1].stop_reason.name if finals else None


class CountingEngine:
    """A paged engine whose next token is always the sequence's last token + 1; it records its steps
    and can be made to fail the next step."""

    def __init__(self) -> None:
        self.spec = spec()
        self.kv_shape = KVCacheShape(1, 1, 1, 4)
        self.steps: list[StepBatch] = []
        self.fail_next: Exception | None = None
        self.copies: list[tuple[int, int]] = []

    def allocate(self, num_blocks: int, block_size: int) -> None:
        pass

    def step(self, batch: StepBatch) -> StepOutput:
        fault, self.fail_next = self.fail_next, None
        if fault is not None:
            raise fault
        self.steps.append(batch)
        kept: list[int] = []  # the token at each kept position
        rows: list[range] = []
        for chunk in batch.chunks:
            tokens = chunk.token_ids if chunk.all_logits else chunk.token_ids[-1:] if chunk.sample else ()
            rows.append(range(len(kept), len(kept) + len(tokens)))
            kept.extend(tokens)
        # A kept row's "hidden state" is its position's token, as a one-element float row.
        hidden = torch.tensor(kept, dtype=torch.float32)[:, None] if batch.hidden else None
        return StepOutput(_counting(kept), rows, hidden)

    def load_lora(self, adapter: LoraAdapter) -> None:
        pass

    def unload_lora(self, adapter_id: str) -> None:
        pass

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.copies.extend(pairs)  # it holds no keys and values: a test reads what was asked

    def capture_decode_graphs(self, max_positions: int, max_batch: int) -> str | None:
        return "a counting engine has no graphs"

    def export_fused_steps(self) -> str | None:
        return "a counting engine has no fused step"

    preferred_block_size = 16
    attention_path = "counting"
    attention_fallback = None
    graphs_captured = 0

    def workspace_bytes(self, positions: int) -> int:
        return 0


def _counting(token_ids: Sequence[int]) -> torch.Tensor:
    """Logits whose argmax after each token is that token + 1."""
    logits = torch.full((len(token_ids), VOCAB), -10.0)
    for row, token in enumerate(token_ids):
        logits[row, (token + 1) % VOCAB] = 10.0
    return logits


@dataclass
class ScriptedRunner:
    """A batch runner with no engine: `capacity` tasks run at once, each gains token 100 + its count per
    step. A test paces steps through `gate` and scripts failures by id."""

    capacity: int = 4
    gate: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(10_000))
    executing: threading.Event = field(default_factory=threading.Event)
    fail_rows: dict[int, str] = field(default_factory=dict)
    refuse: set[int] = field(default_factory=set)
    fatal: BaseException | None = None
    probe_error: Exception | None = None
    running: dict[int, int] = field(default_factory=dict)  # id -> tokens so far
    released: list[int] = field(default_factory=list)
    steps: int = 0

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def select(self, waiting: Sequence[GenerationTask]) -> Selection:
        room = max(self.capacity - len(self.running), 0)
        return Selection(indices=list(range(min(room, len(waiting)))))

    def add(self, task: GenerationTask) -> None:
        if task.id in self.refuse:
            raise ValueError(f"task {task.id} refused")
        self.running[task.id] = 0

    def schedule(self) -> object | None:
        return list(self.running) if self.running else None

    def execute(self, plan: object) -> StepResult:
        assert isinstance(plan, list)
        self.executing.set()
        assert self.gate.acquire(timeout=WAIT_SECONDS), "the test never released this step"
        self.executing.clear()
        if self.fatal is not None:
            raise self.fatal
        self.steps += 1
        failed = {i: RowFailure(self.fail_rows.pop(i)) for i in plan if i in self.fail_rows}
        tokens = {}
        for task_id in plan:
            if task_id in failed or task_id not in self.running:
                continue
            self.running[task_id] += 1
            tokens[task_id] = (SampledToken(100 + self.running[task_id]),)
        stats = StepStats("next_token", len(plan), 0, 0.0, 0.0, len(plan))
        return StepResult(stats, tokens, failed=failed)

    def release(self, task_ids: Iterable[int]) -> None:
        for task_id in task_ids:
            if self.running.pop(task_id, None) is not None:
                self.released.append(task_id)

    def too_large(self, validated: ValidatedInput) -> str | None:
        return None  # no memory model

    def probe(self, input_ids: Sequence[int]) -> int:
        if self.probe_error is not None:
            raise self.probe_error
        return 42

    def usage(self) -> BatchUsage:
        return BatchUsage(admitted=len(self.running), kv_cache_usage=len(self.running) / self.capacity)

    def unload_loras(self, adapter_ids: Sequence[str]) -> None:
        pass
