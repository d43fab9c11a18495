"""`tgis-bench build-model`: build (once, then cached) a benchmark model and print its directory."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tgis_bench.models.shapes import DEFAULT_SHAPE, SHAPES


def main(argv: Sequence[str]) -> int:
    from tgis_bench.models.build import ensure_bench_model

    p = argparse.ArgumentParser(
        prog="tgis-bench build-model",
        description="Build (once, then cached) a random-weight benchmark model and print its directory.",
    )
    p.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default=DEFAULT_SHAPE,
        help="; ".join(f"{name}: {shape.about}" for name, shape in SHAPES.items()),
    )
    print(ensure_bench_model(shape=p.parse_args(argv).shape))
    return 0
