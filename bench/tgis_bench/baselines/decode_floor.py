"""The torch-alone decode step: a static cache, the model's forward compiled, and argmax; each step timed
alone. The floor under any server's step on the same model and batch: nothing but the model runs."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tgis_bench.load.stats import Percentiles

if TYPE_CHECKING:
    import torch

Model = Any  # a transformers PreTrainedModel
WARMUP_STEPS = 4  # reduce-overhead compiles on the first call, records its CUDA graph on the next ones


@dataclass(frozen=True)
class DecodeFloorResult:
    """Per-step times of `steps` greedy decode steps at `batch_size` after prompts of `prompt_tokens`."""

    batch_size: int
    prompt_tokens: int
    steps: int
    step: Percentiles  # seconds
    timer: str  # "CUDA events" or "time.perf_counter"
    note: str  # how the forward ran (its compile mode, or why it was not compiled)

    @property
    def tokens_per_second(self) -> float:
        return self.batch_size / self.step.p50


@dataclass(frozen=True)
class FloorRun:
    """What one measurement produced: the per-step seconds and every row's greedy tokens."""

    seconds: list[float]
    tokens: list[list[int]]


def decode_floor(
    model: Model, prompts: Sequence[Sequence[int]], *, steps: int, mode: str | None, note: str
) -> DecodeFloorResult:
    """One prefill of the equal-length `prompts` (untimed), WARMUP_STEPS untimed decode steps, then `steps`
    timed ones; the forward compiled with torch.compile `mode` (None: eager)."""
    run = run_decode_steps(model, prompts, steps=steps, mode=mode)
    step = Percentiles.of(run.seconds)
    assert step is not None  # steps >= 1
    timer = "CUDA events" if model.device.type == "cuda" else "time.perf_counter"
    return DecodeFloorResult(len(prompts), len(prompts[0]), steps, step, timer, note)


def run_decode_steps(
    model: Model, prompts: Sequence[Sequence[int]], *, steps: int, mode: str | None
) -> FloorRun:
    import torch
    from transformers import StaticCache

    if steps < 1 or len({len(prompt) for prompt in prompts}) != 1:
        raise ValueError("the decode floor needs at least one step and prompts of one length")
    ids = torch.tensor([list(prompt) for prompt in prompts], device=model.device)
    length = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=length + WARMUP_STEPS + steps + 1)
    forward = _forward(model, cache)
    with torch.no_grad():
        positions = torch.arange(length, device=model.device).expand(ids.shape[0], -1)
        ids = forward(ids, positions)  # the prefill, eager
        positions = positions[:, -1:] + 1
        # One static graph per batch size: the floor of that exact shape, not a graph made dynamic by the
        # batch sizes compiled before it.
        step = torch.compile(forward, mode=mode, dynamic=False) if mode else forward
        tokens = [ids]
        for _ in range(WARMUP_STEPS):
            ids, positions = _mark_step(step)(ids, positions).clone(), positions + 1
            tokens.append(ids)
        seconds = _timed_steps(step, ids, positions, steps, tokens)
    return FloorRun(seconds, torch.cat(tokens, dim=1).tolist())


def _forward(model: Model, cache: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's forward on `cache`, argmax of the last position: the whole step, nothing around it.
    transformers 5.2x names the cache `cache` and places writes itself; earlier releases take
    `past_key_values` and the cache positions."""
    from engines.common import cache_keyword

    accepts = inspect.signature(model.forward).parameters
    cache_name = cache_keyword(model)
    wants_positions = "cache_position" in accepts

    def forward(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        extra = {cache_name: cache}
        if wants_positions:
            extra["cache_position"] = positions[0]
        logits = model(
            input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **extra
        ).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    return forward


def _mark_step(step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # A new iteration for CUDA graph trees, so the previous step's output may be overwritten (it was cloned).
    import torch

    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    if mark is not None:
        mark()
    return step


def _timed_steps(
    step: Callable[..., torch.Tensor],
    ids: torch.Tensor,
    positions: torch.Tensor,
    steps: int,
    tokens: list[torch.Tensor],
) -> list[float]:
    """Each step's seconds: between CUDA events recorded around it on a GPU, by the wall clock on the CPU
    (where the forward is synchronous). The clone and the position update are in the step, as in any loop."""
    import torch

    cuda = ids.device.type == "cuda"
    marks: list[tuple[Any, Any]] = []
    seconds = []
    for _ in range(steps):
        start = _now(cuda)
        ids, positions = _mark_step(step)(ids, positions).clone(), positions + 1
        end = _now(cuda)
        tokens.append(ids)
        marks.append((start, end))
    if cuda:
        torch.cuda.synchronize()
        seconds = [start.elapsed_time(end) / 1000 for start, end in marks]
    else:
        seconds = [end - start for start, end in marks]
    return seconds


def _now(cuda: bool) -> Any:
    """A recorded CUDA event on a GPU, else the wall clock."""
    import torch

    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
