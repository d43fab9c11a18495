"""In-process baselines on the same model and requests: sequential `generate()` and a raw batched loop."""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tqdm import tqdm

from tgis.benchmark.workload import BenchRequest

if TYPE_CHECKING:
    import torch

# A transformers PreTrainedModel; its annotations type `.to()` and `generate()` too loosely for mypy.
Model = Any

BaselineName = Literal["sequential", "batched"]
BASELINES: tuple[BaselineName, ...] = ("sequential", "batched")


@dataclass(frozen=True)
class BaselineResult:
    """Tokens the requests asked for, over the wall time it took to produce them."""

    name: BaselineName
    batch_size: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def load_model(model_dir: Path) -> Model:
    """The model as the server's default engine loads it: float32 on CPU, float16 on CUDA."""
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model: Model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return model.to(device).eval()


def pad_token_id(model: Model) -> int:
    config = model.config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0]
        if candidate is not None:
            return int(candidate)
    return 0


def sequential_generate(
    model: Model, requests: Sequence[BenchRequest], *, progress: bool = True
) -> BaselineResult:
    """transformers `generate()`, greedy, one request at a time, min = max new tokens as the server got."""
    import torch

    pad = pad_token_id(model)
    tokens = 0
    bar = tqdm(requests, desc="baseline sequential generate()", unit="req", disable=not progress)
    started = time.perf_counter()
    with torch.inference_mode():
        for request in bar:
            ids = torch.tensor([request.input_ids], device=model.device)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                num_beams=1,
                max_new_tokens=request.max_new_tokens,
                min_new_tokens=request.max_new_tokens,
                pad_token_id=pad,
            )
            tokens += _checked(out.shape[1] - ids.shape[1], request)
    return BaselineResult("sequential", 1, tokens, time.perf_counter() - started)


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

    ids, mask = _left_padded(chunk, pad_token_id(model), model.device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    accepts = inspect.signature(model.forward).parameters

    def forward(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        extra: dict[str, Any] = {}
        if "position_ids" in accepts:  # bloom-style models have none
            extra["position_ids"] = positions
        if "logits_to_keep" in accepts:
            extra["logits_to_keep"] = 1
        return model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, **extra)

    with torch.inference_mode():
        out = forward(ids, mask, positions, DynamicCache())
        ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        positions = positions[:, -1:]
        bar.update()
        for _ in range(max(r.max_new_tokens for r in chunk) - 1):
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions + 1
            out = forward(ids, mask, positions, out.past_key_values)
            ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            bar.update()


def _left_padded(
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


def _checked(generated: int, request: BenchRequest) -> int:
    if generated != request.max_new_tokens:
        raise RuntimeError(
            f"generate() made {generated} tokens for request {request.index}, asked {request.max_new_tokens}"
        )
    return generated


def run_baselines(
    model_dir: Path,
    requests: Sequence[BenchRequest],
    names: Sequence[BaselineName],
    *,
    batch_size: int,
    progress: bool = True,
) -> list[BaselineResult]:
    """Each named baseline on the same requests, after untimed two-token warm-ups of each (the batched one
    at full batch size, as the server is warm at the top concurrency from the levels before it)."""
    if not names:
        return []
    model = load_model(model_dir)
    warmup = [dataclasses.replace(r, max_new_tokens=2) for r in requests[:batch_size]]
    sequential_generate(model, warmup[:1], progress=False)
    if "batched" in names:
        batched_decode(model, warmup, batch_size=batch_size, progress=False)
    results = []
    for name in names:
        if name == "sequential":
            results.append(sequential_generate(model, requests, progress=progress))
        else:
            results.append(batched_decode(model, requests, batch_size=batch_size, progress=progress))
    return results
