"""TGIS's CUDA defaults: PYTORCH_CUDA_ALLOC_CONF where unset (removed where set empty), and TF32 for
CUDA matmuls unless ALLOW_TF32=false; each overridable."""

from __future__ import annotations

import pytest
import torch

from tgis.cli import cuda_process_defaults
from tgis.config import Settings
from tgis.startup.cuda_memory import set_tf32


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ({}, "expandable_segments:True"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "backend:cudaMallocAsync"),
        ({"PYTORCH_CUDA_ALLOC_CONF": " "}, None),
    ],
)
def test_the_allocator_setting_defaults_as_tgis_launcher_sets_it(
    given: dict[str, str], kept: str | None
) -> None:
    environ = dict(given)
    cuda_process_defaults(Settings(), environ)
    assert environ.get("PYTORCH_CUDA_ALLOC_CONF") == kept


@pytest.mark.parametrize(("allow", "override"), [(True, "1"), (False, None)])
def test_tf32_reaches_the_shard_processes_unless_turned_off(allow: bool, override: str | None) -> None:
    environ: dict[str, str] = {}
    cuda_process_defaults(Settings(allow_tf32=allow), environ)
    assert environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == override


def test_tf32_flags_follow_the_setting_on_cuda_and_stay_untouched_elsewhere() -> None:
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        set_tf32(True, torch.device("cpu"))
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
        set_tf32(True, torch.device("cuda"))  # the flags are process globals, settable without a GPU
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_tf32(False, torch.device("cuda"))
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
