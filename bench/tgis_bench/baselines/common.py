"""The in-process baselines' names and results, the model they load, and the raw batched decode loop (the
`generate()` baselines are in baselines.generate, running them all in baselines.plan)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tqdm import tqdm

from tgis_bench.load.workload import BenchRequest

if TYPE_CHECKING:
    import torch

# A transformers PreTrainedModel; its annotations type `.to()` and `generate()` too loosely for mypy.
Model = Any

BaselineName = Literal["sequential", "batched", "generate-batched", "compiled", "compiled-batched"]
# In the order they run: the eager ones before anything is compiled.
ALL_BASELINES: tuple[BaselineName, ...] = (
    "sequential",  # generate(), one request at a time
    "batched",  # the raw greedy loop at the top batch size
    "generate-batched",  # generate() at the top batch size
    "compiled",  # generate() with a static cache + torch.compile, one request at a time
    "compiled-batched",  # the same at the top batch size
)
BASELINES: tuple[BaselineName, ...] = ("sequential", "batched")  # the default
BASELINE_LABELS: dict[str, str] = {
    "sequential": "sequential generate()",
    "batched": "raw batched decode loop",
    "generate-batched": "batched generate()",
    "compiled": "sequential generate(), static cache + torch.compile",
    "compiled-batched": "batched generate(), static cache + torch.compile",
}


@dataclass(frozen=True)
class BaselineResult:
    """Tokens the requests asked for, over the wall time it took to produce them."""

    name: BaselineName
    batch_size: int
    tokens: int
    seconds: float
    note: str = ""  # how it ran where that is not all in its name (the static cache's compile mode)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def load_model(model_dir: Path, dtype: str) -> Model:
    """The model in the dtype the server runs, on the GPU where there is one (as the server puts it)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model: Model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), local_files_only=True
    )
    return model.to(device).eval()


def pad_token_id(model: Model) -> int:
    config = model.config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0]
        if candidate is not None:
            return int(candidate)
    return 0


def batched_decode(
    model: Model, requests: Sequence[BenchRequest], *, batch_size: int, progress: bool = True
) -> BaselineResult:
    """A raw greedy loop over batches of `batch_size`: one left-padded prefill, then argmax decode steps
    with a DynamicCache until every row has its tokens. No scheduler, no sampler, no detokenizer."""
    if model.config.is_encoder_decoder:
        raise ValueError("the batched baseline runs decoder-only models")
    chunks = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    steps = sum(max(r.max_new_tokens for r in chunk) for chunk in chunks)
    bar = tqdm(
        total=steps, desc=f"baseline batched decode (batch {batch_size})", unit="step", disable=not progress
    )
    started = time.perf_counter()
    for chunk in chunks:
        _decode_chunk(model, chunk, bar)
    seconds = time.perf_counter() - started
    bar.close()
    # Rows that asked for fewer tokens than the longest also ran to the end; only asked tokens count.
    return BaselineResult("batched", batch_size, sum(r.max_new_tokens for r in requests), seconds)


def _decode_chunk(model: Model, chunk: Sequence[BenchRequest], bar: tqdm) -> None:
    import torch
    from transformers import DynamicCache

    from engines.common import cache_keyword

    ids, mask = left_padded(chunk, pad_token_id(model), model.device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    accepts = inspect.signature(model.forward).parameters
    cache = DynamicCache()  # filled in place by every forward
    cache_name = cache_keyword(model)

    def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> Any:
        extra: dict[str, Any] = {cache_name: cache}
        if "position_ids" in accepts:  # bloom-style models have none
            extra["position_ids"] = positions
        if "logits_to_keep" in accepts:
            extra["logits_to_keep"] = 1
        return model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)

    with torch.inference_mode():
        out = forward(ids, mask, positions)
        ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        positions = positions[:, -1:]
        bar.update()
        for _ in range(max(r.max_new_tokens for r in chunk) - 1):
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions + 1
            out = forward(ids, mask, positions)
            ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            bar.update()


def left_padded(
    chunk: Sequence[BenchRequest], pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    length = max(len(r.input_ids) for r in chunk)
    ids = torch.full((len(chunk), length), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), length), dtype=torch.long)
    for row, request in enumerate(chunk):
        ids[row, length - len(request.input_ids) :] = torch.tensor(request.input_ids)
        mask[row, length - len(request.input_ids) :] = 1
    return ids.to(device), mask.to(device)
