"""The benchmark model: GPT-2-small-shaped random weights with the demo tokenizer, built once and cached."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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

logger = logging.getLogger(__name__)

VERSION = "v1"
DIR_NAME = f"bench-gpt2-small-{VERSION}"
SEED = 20240612


@dataclass(frozen=True)
class BenchShape:
    """GPT-2 small's layers, width and heads, with the demo tokenizer's 2048-token vocabulary (87M
    parameters, not GPT-2's 124M with its 50k vocabulary); change it only together with VERSION."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    positions: int = 1024


SHAPE = BenchShape()


def ensure_bench_model(cache_root: Path | None = None) -> Path:
    """The benchmark model directory, building it first (seconds, plus the demo model once) if needed."""
    final = (cache_root or default_cache_root()) / DIR_NAME
    if (final / MARKER).exists():
        return final
    tokenizer_dir = ensure_demo_model(cache_root)
    final.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(final):
        if not (final / MARKER).exists():
            _build_and_publish(final, tokenizer_dir)
    return final


def _build_and_publish(final: Path, tokenizer_dir: Path) -> None:
    logger.info(f"Building the benchmark model at {final}")
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build_bench_model(staging, tokenizer_dir)
        make_readable(staging)
        marker = {"version": VERSION, "seed": SEED, "shape": asdict(SHAPE)}
        (staging / MARKER).write_text(json.dumps(marker))
        publish(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"Built the benchmark model at {final} in {time.perf_counter() - started:.1f}s")


def build_bench_model(out_dir: Path, tokenizer_dir: Path, shape: BenchShape = SHAPE) -> None:
    """Random weights from a fixed seed (safetensors) plus the tokenizer files of `tokenizer_dir`."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.model_max_length = shape.positions
    eos = tokenizer.eos_token_id
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=shape.positions,
        n_embd=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    with quiet_transformers(), torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(config).eval()
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
