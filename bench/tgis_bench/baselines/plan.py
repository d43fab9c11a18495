"""Which in-process baselines a run measures and running them on one loaded model: the warm-ups, the order
(eager before compiled), the batch each runs at, and the torch-alone decode floor last."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tgis_bench.baselines.common import (
    ALL_BASELINES,
    BASELINE_LABELS,
    BASELINES,
    BaselineName,
    BaselineResult,
    batched_decode,
    load_model,
)
from tgis_bench.baselines.decode_floor import DecodeFloorResult, decode_floor
from tgis_bench.baselines.generate import StaticCompile, generate_batches, static_compile
from tgis_bench.load.workload import BenchRequest, LengthRange, WorkloadSpec, build_workload, level_requests

logger = logging.getLogger(__name__)

Model = Any  # a transformers PreTrainedModel
_AT_TOP_BATCH: frozenset[BaselineName] = frozenset({"batched", "generate-batched", "compiled-batched"})
_STATIC: frozenset[BaselineName] = frozenset({"compiled", "compiled-batched"})


@dataclass(frozen=True)
class BaselinePlan:
    """What the benchmark process measures on the model once the server runs are done."""

    names: tuple[BaselineName, ...] = BASELINES
    batch_size: int = 32  # the batched ones' batch: the sweep's top concurrency unless asked otherwise
    dtype: str = "float32"  # the server's, so both run the same arithmetic
    per_client: int | None = None  # as the sweep: a baseline at batch b runs the first per_client × b
    compile_cpu: bool = False  # also compile the static-cache baselines and the floor on the CPU
    floor_batches: tuple[int, ...] = ()  # torch-alone decode step at these batch sizes
    floor_prompt_tokens: int = 128
    floor_steps: int = 32
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.names) - set(ALL_BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; known: {', '.join(ALL_BASELINES)}")
        if self.floor_batches and (min(self.floor_batches) < 1 or self.floor_steps < 1):
            raise ValueError("the decode floor needs positive batch sizes and steps")

    def batch_of(self, name: BaselineName) -> int:
        return self.batch_size if name in _AT_TOP_BATCH else 1


@dataclass(frozen=True)
class BaselineOutcome:
    """The baselines' results, the decode floor's, and a line for each that could not run."""

    results: list[BaselineResult] = field(default_factory=list)
    floor: list[DecodeFloorResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def run_baselines(model_dir: Path, requests: Sequence[BenchRequest], plan: BaselinePlan) -> BaselineOutcome:
    """Each named baseline, in ALL_BASELINES' order, then the decode floor, on one loaded model. A
    compiled one that fails (a compiler missing, an unsupported mode) is logged and reported as failed,
    so it cannot cost the run the figures already measured."""
    if not plan.names and not plan.floor_batches:
        return BaselineOutcome()
    model = load_model(model_dir, plan.dtype)
    static = static_compile(model.device, compile_cpu=plan.compile_cpu)
    outcome = BaselineOutcome()
    for name in (name for name in ALL_BASELINES if name in plan.names):
        chosen = level_requests(requests, plan.batch_of(name), plan.per_client)
        try:
            outcome.results.append(_measure(model, name, chosen, plan, static))
        except Exception as error:
            if name not in _STATIC:
                raise
            _failed(outcome, BASELINE_LABELS[name], error)
    if plan.floor_batches:
        _run_floor(model, model_dir, plan, static, outcome)
    return outcome


def _measure(
    model: Model,
    name: BaselineName,
    requests: Sequence[BenchRequest],
    plan: BaselinePlan,
    static: StaticCompile,
) -> BaselineResult:
    """An untimed warm-up, then the timed run. Eager ones warm up on two tokens per request; a compiled
    one on its first full batch, as the timed run's shapes are the ones it must have compiled for."""
    batch = plan.batch_of(name)
    if name == "batched":
        warmup = [dataclasses.replace(r, max_new_tokens=2) for r in requests[:batch]]
        batched_decode(model, warmup, batch_size=batch, progress=False)
        return batched_decode(model, requests, batch_size=batch, progress=plan.progress)
    cache = static if name in _STATIC else None
    first = list(requests[:batch])
    if cache is None:
        first = [dataclasses.replace(r, max_new_tokens=2) for r in first]
    generate_batches(model, first, batch_size=batch, static=cache, progress=False)
    tokens, seconds = generate_batches(
        model, requests, batch_size=batch, static=cache, progress=plan.progress, label=BASELINE_LABELS[name]
    )
    return BaselineResult(name, batch, tokens, seconds, cache.note if cache else "")


def _run_floor(
    model: Model, model_dir: Path, plan: BaselinePlan, static: StaticCompile, outcome: BaselineOutcome
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    length = LengthRange(plan.floor_prompt_tokens, plan.floor_prompt_tokens)
    prompts = build_workload(tokenizer, WorkloadSpec(max(plan.floor_batches), length, LengthRange(1, 1)))
    for batch in plan.floor_batches:
        ids = [prompt.input_ids for prompt in prompts[:batch]]
        try:
            outcome.floor.append(
                decode_floor(model, ids, steps=plan.floor_steps, mode=static.mode, note=static.note)
            )
        except Exception as error:
            _failed(outcome, f"decode floor at batch {batch}", error)


def _failed(outcome: BaselineOutcome, what: str, error: Exception) -> None:
    logger.exception(f"{what} failed")
    first_line = (str(error).splitlines() or [""])[0][:200]
    outcome.failures.append(f"{what}: failed ({type(error).__name__}: {first_line})")
