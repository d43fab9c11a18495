"""Op-by-op tanh-GELU modules swapped for transformers' fused GELUTanh (engines/fused_activations.py):
the same logits, and the architectures whose activation is already one kernel are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.activations import GELUTanh

from engines.fused_activations import fuse_activations
from tests.fixtures.tiny import logits_side_by_side, make_model

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# make_model's activations: gpt2 "gelu_new", bloom its BloomGelu, t5 gated-gelu ("gelu_new");
# llama's SiLU and gpt_neox's exact GELU are single torch calls already.
SWAPPED = {"gpt2": 2, "bloom": 2, "t5": 4, "llama": 0, "gpt_neox": 0}


@pytest.mark.parametrize("arch", sorted(SWAPPED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_computes_the_same_logits(arch: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    plain = make_model(arch).to(dtype).eval()  # type: ignore[arg-type]
    fused = copy.deepcopy(plain)
    assert fuse_activations(fused) == SWAPPED[arch]
    assert sum(isinstance(m, GELUTanh) for m in fused.modules()) == SWAPPED[arch]
    want, got = logits_side_by_side(plain, fused)
    assert (got - want).abs().max() <= TOLERANCE[dtype] * want.abs().max()
    assert fuse_activations(fused) == 0  # nothing left to swap
