"""CUDA_PROCESS_MEMORY_FRACTION as TGIS applies it: the CUDA caching allocator's cap for this process."""

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
