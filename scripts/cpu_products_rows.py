"""Each CPU product a linear layer can take, side by side at each row count on this CPU: where the CPU
kernels' few-row products stop paying against oneDNN's and torch's (engines/cpu_prepack.py's
KERNEL_ROWS and BF16_KERNEL_ROWS, cpu_products.cpp's INT8_MAX_ROWS), measured per CPU kind.

GPT-2-small's 48 block weights (random values, the benchmark model's shapes) are called once each per
timing, as a decode step calls them; the paths alternate within each round and a path's figure is the
median of the rounds (with the range), in milliseconds for all 48. Paths this CPU cannot run are left
out and named.

- bfloat16 and float32: oneDNN on the weight packed at load (what `prepack_linears` serves past the
  few-row limit), and the kernels' few-row product on the dense weight (`tgis::few_rows_linear`);
- int8: the served layer (`tgis::int8_linear`), and its int32 sums alone: the kernels' VNNI product
  (`int8_rows`, up to 8 rows) against `torch._int_mm` (oneDNN's VNNI/AMX kernels), on the same int8 rows;
- int4 (groups of 128): the kernels' product as served (`tgis::int4_linear`: on the AMX tiles where
  the CPU has them, and then the row kernel beside it) and torch's (`torch._weight_int4pack_mm_for_cpu`,
  activations in bfloat16).

    python scripts/cpu_products_rows.py                       # rows 1, 2, 4, 8, 16, 32; 15 rounds
    python scripts/cpu_products_rows.py --rows 1,3,6 --rounds 31
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engines.int4_layouts import kernel_int4_tensors
from engines.paged import cpu_kernel
from engines.quantized import install_int4, install_int8, int4_groupwise, int8_per_channel, torch_int4_scales

HIDDEN = 768
LAYERS = 12
# A GPT-2 block's four weights, [outputs, inputs]: attention in and out, MLP up and down.
BLOCK_SHAPES = ((3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN))
GROUP = 128

Call = Callable[[int], object]  # one call of all 48 weights at this many rows


def weights() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) * 0.02 for _ in range(LAYERS) for shape in BLOCK_SHAPES]


@functools.cache
def rows_of(width: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Activations, made once (the warm-up round), outside the timings."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, (rows, width), dtype=torch.int8)
    return torch.randn(rows, width).to(dtype)


def dense_paths(dense: list[torch.Tensor], built: cpu_kernel.Kernels | None) -> dict[str, Call]:
    paths: dict[str, Call] = {}
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        typed = [w.to(dtype).contiguous() for w in dense]
        paths[f"{name} oneDNN packed"] = _onednn(typed)
        if built is not None and (dtype == torch.float32 or built.bf16_rows):
            paths[f"{name} few-row kernel"] = _few_rows(typed)
    return paths


def _onednn(typed: list[torch.Tensor]) -> Call:
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in typed]

    def call(rows: int) -> None:
        xs = {w.shape[1]: rows_of(w.shape[1], rows, w.dtype) for w in typed}
        for w, p in zip(typed, packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    return call


def _few_rows(typed: list[torch.Tensor]) -> Call:
    def call(rows: int) -> None:
        xs = {w.shape[1]: rows_of(w.shape[1], rows, w.dtype) for w in typed}
        for w in typed:
            torch.ops.tgis.few_rows_linear(xs[w.shape[1]], w, None)

    return call


def quantized_layers(
    dense: list[torch.Tensor], install: Callable[[nn.Linear, torch.Tensor], None]
) -> list[Any]:
    """Each weight in a bias-free bfloat16 layer, quantized by `install` as the server quantizes it."""
    layers = []
    for weight in dense:
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
        install(layer, weight)
        layers.append(layer)
    return layers


def int8_paths(dense: list[torch.Tensor], built: cpu_kernel.Kernels | None) -> dict[str, Call]:
    layers = quantized_layers(
        dense, lambda layer, w: install_int8(layer, *int8_per_channel(w), torch.bfloat16)
    )
    widths = {layer.in_features for layer in layers}

    def int_mm(rows: int) -> None:
        xs = {width: rows_of(width, rows, torch.int8) for width in widths}
        for layer in layers:
            torch._int_mm(xs[layer.in_features], layer.q8_weight.t())

    paths: dict[str, Call] = {"int8 sums, torch._int_mm": int_mm}
    if built is None:
        return paths

    def served(rows: int) -> None:
        xs = {width: rows_of(width, rows, torch.bfloat16) for width in widths}
        for layer in layers:
            torch.ops.tgis.int8_linear(
                xs[layer.in_features], layer.q8_weight, layer.q8_scale32, layer.q8_sums, None
            )

    paths["int8 layer served (tgis::int8_linear, bfloat16)"] = served
    if built.int8_rows is not None:
        int8_rows = built.int8_rows

        def vnni(rows: int) -> None:
            if rows > 8:
                raise _NotTaken
            xs = {width: rows_of(width, rows, torch.int8) for width in widths}
            for layer in layers:
                int8_rows(xs[layer.in_features], layer.q8_weight, layer.q8_sums)

        paths["int8 sums, kernels' VNNI (<= 8 rows)"] = vnni
    return paths


def int4_paths(dense: list[torch.Tensor], built: cpu_kernel.Kernels | None) -> dict[str, Call]:
    grouped = [int4_groupwise(w, GROUP) for w in dense]
    widths = {w.shape[1] for w in dense}
    paths: dict[str, Call] = {}
    try:
        torch_packed = [
            (
                torch._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32).contiguous(), 1),
                torch_int4_scales(g).to(torch.bfloat16),
            )
            for g in grouped
        ]
    except RuntimeError as exc:
        print(f"torch's int4 product left out: {str(exc).splitlines()[0]}")
    else:

        def torch_int4(rows: int) -> None:
            xs = {width: rows_of(width, rows, torch.bfloat16) for width in widths}
            for g, (packed, scales) in zip(grouped, torch_packed, strict=True):
                torch._weight_int4pack_mm_for_cpu(xs[g.q.shape[1]], packed, GROUP, scales)

        paths["int4 torch._weight_int4pack_mm_for_cpu"] = torch_int4
    if built is not None and built.int4_rows:  # install_int4 takes the kernels' layout here
        layers = quantized_layers(
            dense, lambda layer, w: install_int4(layer, int4_groupwise(w, GROUP), torch.bfloat16)
        )
        served = [
            (layer.in_features, (layer.q4_nibbles, layer.q4_scale32, layer.q4_scaled_zero32))
            for layer in layers
        ]
        paths["int4 layer served (tgis::int4_linear, bfloat16)"] = _int4_kernel(served)
    if built is not None and built.int4_tiles:  # served on the AMX tiles: the row kernel beside them
        row_layout = [
            (g.q.shape[1], kernel_int4_tensors(g.q, g.scale, g.zero, GROUP, tiled=False)) for g in grouped
        ]
        paths["int4 row kernel (tgis::int4_linear, row layout)"] = _int4_kernel(row_layout)
    return paths


def _int4_kernel(layouts: list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]) -> Call:
    """`tgis::int4_linear` on each weight's (width, kernel tensors), bfloat16 activations."""

    def call(rows: int) -> None:
        xs = {width: rows_of(width, rows, torch.bfloat16) for width, _ in layouts}
        for width, tensors in layouts:
            torch.ops.tgis.int4_linear(xs[width], *tensors, GROUP, None)

    return call


class _NotTaken(Exception):
    """The path does not take this many rows."""


def timed(call: Call, rows: int) -> float | None:
    try:
        started = time.perf_counter()
        call(rows)
        return (time.perf_counter() - started) * 1e3
    except _NotTaken:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="row counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=15, help="alternated rounds; the median is reported")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]

    from tgis_bench.machine import machine_info

    info = machine_info()
    print(
        f"{info.cpu}, {info.cores} cores ({info.cpu_flags}); torch {info.torch}, {info.torch_threads} threads"
    )
    built = cpu_kernel.kernels()
    if built is None:
        print("The CPU kernels could not be built: their paths are left out.")
    dense = weights()
    paths = {**dense_paths(dense, built), **int8_paths(dense, built), **int4_paths(dense, built)}
    torch.set_grad_enabled(False)
    times: dict[tuple[str, int], list[float]] = {}
    for rows in row_counts:  # warm-up: every path once at every row count
        for call in paths.values():
            timed(call, rows)
    for _ in range(args.rounds):
        for rows in row_counts:
            for name, call in paths.items():
                took = timed(call, rows)
                if took is not None:
                    times.setdefault((name, rows), []).append(took)

    print(f"\nms for GPT-2-small's 48 block weights, median of {args.rounds} alternated rounds (range)\n")
    print("| path | " + " | ".join(f"{rows} rows" for rows in row_counts) + " |")
    print("|---|" + "---:|" * len(row_counts))
    for name in paths:
        cells = []
        for rows in row_counts:
            runs = times.get((name, rows))
            cells.append(f"{statistics.median(runs):.2f} ({min(runs):.2f}-{max(runs):.2f})" if runs else "—")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
