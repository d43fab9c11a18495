"""The CPU decode-attention kernel (cpu_decode.cpp), compiled once per source, torch and CPU.

Decode attention is most of a paged decode step on CPU when it gathers every sequence's blocks into a
padded copy first (GPT-2-small shape, 32 sequences of 200 positions, bfloat16, 2 cores: 11.5 ms per
layer through gather + SDPA, against 2.2 ms for all of the layer's matmuls). The kernel reads the
blocks in place. torch.utils.cpp_extension builds it with the machine's compiler into torch's
extension cache (TORCH_EXTENSIONS_DIR); where that fails, decode falls back to the pure-torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")

# (query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, skip) -> (out, lse)
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, int],
    tuple[torch.Tensor, torch.Tensor],
]


@functools.cache
def decode_kernel() -> DecodeKernel | None:
    """The compiled kernel, built on first use (about 20 s, then cached on disk); None if it cannot be."""
    source = SOURCE.read_text()
    key = f"{source}\0{torch.__version__}\0{torch.backends.cpu.get_cpu_capability()}"
    name = f"tgis_paged_cpu_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    started = time.monotonic()
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name=name,
            cpp_sources=[source],
            functions=["decode_attention"],
            # -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, inlined from its headers.
            extra_cflags=["-O3", "-march=native", "-fno-strict-aliasing", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        logger.warning(f"CPU paged-attention kernel unavailable, decode gathers blocks instead: {exc}")
        return None
    logger.info(f"CPU paged-attention kernel ready in {time.monotonic() - started:.1f} s")
    return module.decode_attention
