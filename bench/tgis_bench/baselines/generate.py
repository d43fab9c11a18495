"""The `generate()` baselines: transformers' own greedy generation, one request or a left-padded batch at a
time, with its dynamic cache (eager) or a static cache that `torch.compile` compiles."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from tgis_bench.baselines.common import left_padded, pad_token_id
from tgis_bench.load.workload import BenchRequest

if TYPE_CHECKING:
    import torch

# A transformers PreTrainedModel; its annotations type `.to()` and `generate()` too loosely for mypy.
Model = Any


@dataclass(frozen=True)
class StaticCompile:
    """How the static-cache baselines run on this device: compiled with `mode`, or (None) eagerly."""

    mode: str | None
    note: str


def static_compile(device: torch.device, *, compile_cpu: bool) -> StaticCompile:
    """reduce-overhead (CUDA graphs) on a GPU; on the CPU only when asked, in the default mode, since
    compiling takes minutes on a small machine and there are no CUDA graphs to capture."""
    if device.type == "cuda":
        return StaticCompile("reduce-overhead", "torch.compile mode=reduce-overhead (CUDA graphs)")
    if compile_cpu:
        return StaticCompile("default", "torch.compile mode=default (CPU, --compile-cpu)")
    return StaticCompile(None, "not compiled: on the CPU torch.compile runs only with --compile-cpu")


def generate_kwargs(static: StaticCompile | None) -> dict[str, Any]:
    """`generate()`'s cache and compile settings: its default dynamic cache (None), or a static cache
    that generate() compiles itself (transformers compiles the forward of a static cache on CUDA)."""
    if static is None:
        return {}
    if static.mode is None:
        return {"cache_implementation": "static", "disable_compile": True}
    from transformers import CompileConfig

    config = CompileConfig(mode=static.mode)
    if static.mode != "reduce-overhead":  # the CPU, asked for: generate() compiles only on CUDA unless told
        config._compile_all_devices = True  # type: ignore[assignment]
    return {"cache_implementation": "static", "compile_config": config}


def generate_batches(
    model: Model,
    requests: Sequence[BenchRequest],
    *,
    batch_size: int,
    static: StaticCompile | None,
    progress: bool = True,
    label: str = "generate()",
) -> tuple[int, float]:
    """Greedy `generate()` over left-padded batches of `batch_size`, each run to its longest request's
    budget (min = max new tokens, as the server is asked); returns the asked tokens and the seconds."""
    import torch

    pad = pad_token_id(model)
    chunks = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    bar = tqdm(chunks, desc=f"baseline {label}", unit="batch", disable=not progress)
    started = time.perf_counter()
    with torch.no_grad():  # what generate() itself runs under, compiled or not
        for chunk in bar:
            ids, mask = left_padded(chunk, pad, model.device)
            budget = max(r.max_new_tokens for r in chunk)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                num_beams=1,
                max_new_tokens=budget,
                min_new_tokens=budget,
                pad_token_id=pad,
                **generate_kwargs(static),
            )
            if out.shape[1] - ids.shape[1] != budget:
                raise RuntimeError(f"generate() made {out.shape[1] - ids.shape[1]} tokens, asked {budget}")
    # Rows that asked for fewer tokens than the longest also ran to the end; only asked tokens count.
    return sum(r.max_new_tokens for r in requests), time.perf_counter() - started
