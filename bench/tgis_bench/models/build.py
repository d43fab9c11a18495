"""The benchmark models: random weights of a named shape (shapes.py) with a local tokenizer, built once and
cached."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The demo model's cache conventions (lock, whole-directory rename, readable files) apply here as-is.
from tgis.demo_model import (
    MARKER,
    build_lock,
    default_cache_root,
    ensure_demo_model,
    make_readable,
    publish,
    quiet_transformers,
)
from tgis_bench.models.shapes import DEFAULT_SHAPE, ShapeSpec, model_config, shape_named
from tgis_bench.models.tokenizer import ensure_bench_tokenizer

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SEED = 20240612


def ensure_bench_model(cache_root: Path | None = None, shape: str | ShapeSpec = DEFAULT_SHAPE) -> Path:
    """The directory of the benchmark model of `shape`, building it first if needed: seconds for the small
    shapes (plus their tokenizer once), a minute or two for llama-1b (docs/benchmarking.md)."""
    spec = shape_named(shape) if isinstance(shape, str) else shape
    final = (cache_root or default_cache_root()) / spec.dir_name
    if (final / MARKER).exists():
        return final
    tokenizer_dir = _tokenizer_dir(spec, cache_root)
    final.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(final):
        if not (final / MARKER).exists():
            _build_and_publish(final, tokenizer_dir, spec)
    return final


def _tokenizer_dir(spec: ShapeSpec, cache_root: Path | None) -> Path:
    if spec.tokenizer == "demo":
        return ensure_demo_model(cache_root)
    return ensure_bench_tokenizer(cache_root)


def _build_and_publish(final: Path, tokenizer_dir: Path, spec: ShapeSpec) -> None:
    logger.info(f"Building the benchmark model at {final}")
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build_bench_model(staging, tokenizer_dir, spec)
        make_readable(staging)
        elapsed = time.perf_counter() - started
        marker = {
            "version": spec.version,
            "seed": SEED,
            "shape": asdict(spec),
            "build_seconds": round(elapsed),
        }
        (staging / MARKER).write_text(json.dumps(marker))
        publish(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"Built the benchmark model at {final} in {elapsed:.1f}s")


def build_bench_model(out_dir: Path, tokenizer_dir: Path, shape: ShapeSpec) -> None:
    """Random weights from a fixed seed (safetensors, in the shape's saved dtype) plus the tokenizer files
    of `tokenizer_dir`."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.model_max_length = shape.positions
    config = model_config(shape, tokenizer)
    with quiet_transformers(), torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = random_model(config, shape)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


def random_model(config: Any, shape: ShapeSpec) -> Any:
    """The model with its random initial weights, created directly in the saved dtype: llama-1b's 1.1B
    parameters take 2.2 GB in bfloat16, where creating them in float32 first would take 4.4 GB more."""
    import torch
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    model_class = GPT2LMHeadModel if shape.family == "gpt2" else LlamaForCausalLM
    with _default_dtype(getattr(torch, shape.saved_dtype)):
        return model_class(config).eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
