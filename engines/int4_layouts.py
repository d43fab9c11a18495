"""The CPU kernels' layouts of int4 weights: what `tgis::int4_linear` (engines/paged/cpu_products.cpp)
reads, two 4-bit values a byte, for its row kernel (a CPU with AVX-512 VNNI or AVX2) or for the AMX tiles.
engines/quantized.py installs them in layers."""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Values 0..15 [N, K] two to a byte [N, K / 2], as cpu_products.cpp's int4_linear unpacks them: in
    units of 128 values where the groups are a multiple of 128, else 64; byte j of a unit holds value j
    in its low nibble and value j + unit / 2 in its high one."""
    n, k = q.shape
    unit = 128 if group_size % 128 == 0 else 64
    units = q.to(torch.uint8).view(n, k // unit, 2, unit // 2)
    return (units[:, :, 0] | (units[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


TILE_OUTPUTS, TILE_FEATURES = 16, 64  # cpu_products.cpp's int4_tile_sums: outputs and features of a tile


def pack_int4_tiles(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [N, K] two to a byte as cpu_products.cpp's int4_tile_sums reads them on the AMX tiles:
    [N / 16, K / 64, 512], a block of 16 outputs' 64 features a time. Unpacked they are the tile the
    product reads, 16 rows of 64 bytes where row i holds features 4i to 4i + 3 of each output in turn;
    byte j of row pair p holds row 2p's byte j in its low nibble and row 2p + 1's in its high one."""
    n, k = q.shape
    blocks, depth = n // TILE_OUTPUTS, k // TILE_FEATURES
    # [block, output, depth, tile row, 4 features] -> [block, depth, tile row, output, 4 features]
    tiles = q.to(torch.uint8).view(blocks, TILE_OUTPUTS, depth, TILE_FEATURES // 4, 4).permute(0, 2, 3, 1, 4)
    pairs = tiles.reshape(blocks, depth, TILE_FEATURES // 8, 2, TILE_OUTPUTS * 4)
    return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(blocks, depth, -1).contiguous()


def tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, groups] as int4_tile_sums reads them: [N / 16, groups, 16], float32."""
    n, groups = scales.shape
    return scales.float().view(n // TILE_OUTPUTS, TILE_OUTPUTS, groups).transpose(1, 2).contiguous()


def kernel_int4_tensors(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, tiled: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `tgis::int4_linear` takes for values `q` [N, K] (0..15) standing for scale * (q - zero) per group:
    the packed values, the float32 scales and the float32 scaled zero points (scale times zero), laid out
    for the AMX tiles (`tiled`, N a multiple of 16) or for the row kernel."""
    scaled_zero = scale * zero
    if tiled:
        return pack_int4_tiles(q), tile_scales(scale), tile_scales(scaled_zero)
    return pack_int4(q, group_size), scale.float().contiguous(), scaled_zero.float().contiguous()
