"""The paged step's CUDA paths on a tiny model: the varlen kernel per layer, and decode graphs.

Each path must give the logits the per-sequence torch path gives. Marked `gpu`: skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engines.base import EngineSpec
from engines.paged import ragged
from engines.paged.engine import build
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # torch 2.11's varlen_attn takes no block table (the image's torch 2.13 does): the engine then serves
    # through the per-sequence path, which tests/integration/test_paged.py checks on CUDA.
    pytest.mark.skipif(
        torch.cuda.is_available() and not ragged.available(torch.device("cuda")),
        reason=f"torch {torch.__version__} has no paged varlen attention (varlen_attn with a block table)",
    ),
]

BLOCK = 16
DTYPE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def cuda_engine(dtype: torch.dtype):
    model = make_model("llama").eval()
    model.to(torch.device("cuda"), dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    spec = EngineSpec(False, model.config.vocab_size, (), 0, device, dtype, paged=True)
    engine = build(model, spec)
    engine.allocate(64, BLOCK)
    return engine


def steps() -> tuple[StepBatch, StepBatch]:
    """A prompt chunk for each of two sequences, then a step that decodes both beside a third prompt."""
    first = StepBatch(
        prefill=(
            SequenceChunk(tuple(range(3, 40)), 0, (0, 1, 2), sample=True),
            SequenceChunk(tuple(range(50, 60)), 0, (5,), sample=True),
        )
    )
    mixed = StepBatch(
        decode=(SequenceChunk((7,), 37, (0, 1, 2), sample=True), SequenceChunk((8,), 10, (5,), sample=True)),
        prefill=(SequenceChunk(tuple(range(70, 90)), 0, (9, 10), all_logits=True),),
    )
    return first, mixed


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_varlen_kernel_serves_the_step_as_the_per_sequence_path_does(dtype) -> None:
    engine = cuda_engine(dtype)
    assert engine.ragged, "the kernel's probe refused a 16-position block"
    first, mixed = steps()
    engine.step(first)
    kernel = engine.step(mixed)
    engine.ragged = False
    engine.step(first)
    plain = engine.step(mixed)
    assert relative(kernel.logits, plain.logits) <= DTYPE_TOLERANCE[dtype]


def test_a_replayed_decode_graph_gives_the_eager_steps_logits() -> None:
    engine = cuda_engine(torch.bfloat16)
    first, _ = steps()
    engine.step(first)
    decode = StepBatch(
        decode=(SequenceChunk((7,), 37, (0, 1, 2), sample=True), SequenceChunk((8,), 10, (5,), sample=True))
    )
    eager = engine.step(decode).logits.clone()
    assert engine.capture_decode_graphs(max_positions=256, max_batch=4) is None
    engine.step(first)  # the same keys and values again
    replayed = engine.step(decode).logits
    assert relative(replayed, eager) <= DTYPE_TOLERANCE[torch.bfloat16]
