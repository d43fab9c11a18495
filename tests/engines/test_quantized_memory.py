"""Memory follows the weights: a model quantized at load keeps no full-precision copy of its quantized
layers, and the process's resident memory shows it (each load in a fresh process, so nothing else it
did is counted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.fixtures.tiny import build_tokenizer

LOAD_AND_MEASURE = """
import gc, sys, psutil
from pathlib import Path
from engines.base import EngineConfig
from engines.registry import load_engine
quantize = None if sys.argv[2] == "none" else sys.argv[2]
config = EngineConfig(model_path=Path(sys.argv[1]), dtype="float32", quantize=quantize)
engine = load_engine("hf_transformers", config)
gc.collect()
print(psutil.Process().memory_info().rss)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A llama of 21M parameters (85 MB in float32): large enough that its weights dominate the
    difference between two loads."""
    out = tmp_path_factory.mktemp("quantized-memory")
    build_tokenizer(out, "llama")
    config = LlamaConfig(
        vocab_size=768, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return out, sum(p.numel() * 4 for p in model.parameters())


def resident_after_load(model: Path, quantize: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_MEASURE, str(model), quantize],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_resident_memory_drops_with_the_weights(model_dir: tuple[Path, int]) -> None:
    path, float32_bytes = model_dir
    dense, int4 = (resident_after_load(path, q) for q in ("none", "int4"))
    # The float32 weights (85 MB) are held at least once unquantized; at int4 (the head at int8) about a
    # sixth of that stays.
    assert dense - int4 > 0.75 * float32_bytes, (dense, int4, float32_bytes)
