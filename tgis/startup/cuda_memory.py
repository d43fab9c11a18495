"""CUDA process settings as TGIS applies them: CUDA_PROCESS_MEMORY_FRACTION (the caching allocator's cap
for this process) and TF32 for float32 matmuls (ALLOW_TF32, on as in TGIS)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def cap_cuda_memory(fraction: float, device: torch.device) -> None:
    """Cap this process's allocations on `device` to `fraction` of its memory; nothing off CUDA
    (where the fraction has nothing to cap)."""
    if device.type != "cuda":
        return
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    if fraction < 1.0:
        logger.info(f"CUDA_PROCESS_MEMORY_FRACTION: allocations on {device} capped at {fraction:.0%}")


def set_tf32(allow: bool, device: torch.device) -> None:
    """TGIS turns TF32 on for CUDA matmuls and cuDNN convolutions; ALLOW_TF32=false keeps full float32.
    Off CUDA there is no TF32 to choose."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    logger.info(f"TF32 for float32 matmuls on {device}: {'on' if allow else 'off (ALLOW_TF32=false)'}")
