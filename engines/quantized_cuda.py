"""The quantized layers' products on CUDA, through torch's own kernels (engines/quantized.py installs them).

- **int8**: each row of activations quantized to int8 as on the CPU, then `torch._int_mm` (cuBLASLt's
  int8 GEMM, int32 sums): the same exact integers as the CPU's product, so a row's result depends on
  that row alone there too. cuBLASLt takes more than 16 rows, so a step of fewer is padded with zero
  rows (the weight is read once whatever the row count; the padding adds no weight traffic).
- **int4**: torch's tinygemm product (`torch._weight_int4pack_mm`, bfloat16 activations, the weight
  packed by `torch._convert_weight_to_int4pack`), with a scale and a zero per group as the CPU's torch
  product takes them (w = (q - 8) * scale + zero').

Each is probed once per device and configuration before it serves: a small layer through the kernel
against the same layer dequantized. A GPU or a shape the kernel does not take (tinygemm needs compute
capability 8.0 and groups of 32-256 features), a torch build without it, or a result that disagrees
leaves the layer on the dequantizing product (correct, without the speed), and says why once in the log.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

INT_MM_MIN_ROWS = 17  # cuBLASLt's int8 GEMM through torch._int_mm takes more than 16 rows
INT_MM_PADDED_ROWS = 24  # fewer rows are padded to this many (a multiple of 8)
INT_MM_ALIGN = 8  # input and output features in multiples of 8
TINYGEMM_GROUPS = (32, 64, 128, 256)
TINYGEMM_INNER_K_TILES = (8, 4, 2)  # the packing's inner tiles, largest first; K a multiple of 16 times it
TINYGEMM_OUTPUTS = 8  # output features in multiples of this
PROBE_TOLERANCE = 2e-2  # of the reference's largest magnitude: bfloat16 rounding, never a wrong layout


# ---- int8 -------------------------------------------------------------------------------------------------


def int_mm_fits(k: int, n: int) -> bool:
    return k % INT_MM_ALIGN == 0 and n % INT_MM_ALIGN == 0


def int_mm_serves(shape: torch.Size, device: torch.device) -> bool:
    """Whether an int8 weight of `shape` [N, K] on `device` takes `int8_sums`: on CUDA, its features
    fitting and the device's probe passed. Decided (and probed) at load, not in a step or a CUDA graph's
    capture."""
    n, k = shape
    return device.type == "cuda" and int_mm_fits(k, n) and int_mm_works(device) is None


def int8_sums(quantized: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums of int8 rows [M, K] with int8 `q` [N, K] through `torch._int_mm`; fewer than
    INT_MM_MIN_ROWS rows are padded with zero rows, whose sums are dropped."""
    rows = quantized.shape[0]
    if rows < INT_MM_MIN_ROWS:
        padding = quantized.new_zeros(INT_MM_PADDED_ROWS - rows, quantized.shape[1])
        quantized = torch.cat([quantized, padding])
    return torch._int_mm(quantized.contiguous(), q.t())[:rows]


@functools.cache
def int_mm_works(device: torch.device) -> str | None:
    """None if `int8_sums` gives the exact sums on `device`, else why not (logged once)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(-127, 128, (3, 64), generator=generator, dtype=torch.int8)
    q = torch.randint(-127, 128, (40, 64), generator=generator, dtype=torch.int8)
    expected = rows.long() @ q.long().t()
    try:
        found = int8_sums(rows.to(device), q.to(device)).long().cpu()
    except Exception as exc:  # no cuBLASLt int8 GEMM here
        return _refused("int8", device, f"torch._int_mm failed: {_first_line(exc)}")
    if not torch.equal(found, expected):
        return _refused("int8", device, "torch._int_mm's sums differ from the exact ones")
    return None


# ---- int4 -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyGemmWeight:
    """An int4 weight in tinygemm's layout."""

    packed: torch.Tensor  # torch._convert_weight_to_int4pack's tiles
    scale_and_zero: torch.Tensor  # [groups, N, 2] bfloat16: w = (q - 8) * scale + zero


def tinygemm_inner_k_tiles(n: int, k: int, group_size: int) -> int | None:
    """The packing's inner tiles for a weight [n, k] in groups of `group_size`, None if tinygemm does
    not take it."""
    if group_size not in TINYGEMM_GROUPS or n % TINYGEMM_OUTPUTS:
        return None
    return next((tiles for tiles in TINYGEMM_INNER_K_TILES if k % (tiles * 16) == 0), None)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [N, K] two to a byte [N, K / 2] as the CUDA packing takes them: feature 2j in byte
    j's high nibble, feature 2j + 1 in its low one."""
    values = q.to(torch.uint8)
    return ((values[:, 0::2] << 4) | values[:, 1::2]).contiguous()


def tinygemm_weight(q: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int) -> TinyGemmWeight | None:
    """`q` [N, K] (values 0..15) with `scale_and_zero` [groups, N, 2] as torch's int4 products take them
    (engines/quantized.py's `torch_int4_scales`), in tinygemm's layout; None off CUDA, or where tinygemm
    does not take the shape or did not pass its probe on `q`'s device."""
    n, k = q.shape
    tiles = tinygemm_inner_k_tiles(n, k, group_size)
    if q.device.type != "cuda" or tiles is None or tinygemm_works(q.device, group_size, tiles) is not None:
        return None
    return _tinygemm_weight(q, scale_and_zero, tiles)


def _tinygemm_weight(q: torch.Tensor, scale_and_zero: torch.Tensor, tiles: int) -> TinyGemmWeight:
    packed = torch._convert_weight_to_int4pack(pack_nibbles(q), tiles)
    return TinyGemmWeight(packed, scale_and_zero.to(q.device, torch.bfloat16).contiguous())


def tinygemm_product(
    rows: torch.Tensor, packed: torch.Tensor, group_size: int, scale_and_zero: torch.Tensor
) -> torch.Tensor:
    """rows [M, K] times an int4 weight in tinygemm's layout (a `TinyGemmWeight`'s tensors), [M, N] in
    the rows' dtype (computed in bfloat16)."""
    out = torch._weight_int4pack_mm(rows.to(torch.bfloat16).contiguous(), packed, group_size, scale_and_zero)
    return out.to(rows.dtype)


@functools.cache
def tinygemm_works(device: torch.device, group_size: int, tiles: int) -> str | None:
    """None if tinygemm's product of a small layer matches the dequantized layer's on `device`, else why
    not (logged once)."""
    generator = torch.Generator().manual_seed(0)
    n, k = 64, max(256, tiles * 16, group_size)
    groups = k // group_size
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale_and_zero = torch.rand(groups, n, 2, generator=generator) * 0.02
    scale_and_zero = scale_and_zero.to(torch.bfloat16).float()  # as the kernel reads them
    rows = torch.randn(5, k, generator=generator).to(torch.bfloat16).float()
    scale, zero = scale_and_zero.unbind(2)  # [groups, N] each: w = (q - 8) * scale + zero
    dense = (q.float().view(n, groups, group_size) - 8) * scale.t()[..., None] + zero.t()[..., None]
    expected = rows @ dense.view(n, k).t()
    try:
        weight = _tinygemm_weight(q.to(device), scale_and_zero, tiles)
        found = tinygemm_product(rows.to(device), weight.packed, group_size, weight.scale_and_zero)
        found = found.float().cpu()
    except Exception as exc:  # an older GPU, or a torch without the CUDA kernel
        return _refused("int4", device, f"tinygemm failed: {_first_line(exc)}")
    error = (found - expected).abs().max().item() / expected.abs().max().item()
    if not error <= PROBE_TOLERANCE:
        return _refused("int4", device, f"tinygemm's product is {error:.3g} off the dequantized layer's")
    return None


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _refused(method: str, device: torch.device, reason: str) -> str:
    logger.warning(f"QUANTIZE {method} on {device}: {reason}; its layers dequantize their weights per call")
    return reason
