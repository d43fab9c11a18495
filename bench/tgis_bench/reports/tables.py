"""The Markdown tables every report shares (the machine, a concurrency sweep) and their cell formats."""

from __future__ import annotations

from collections.abc import Sequence

from tgis_bench.load.stats import Percentiles, RunSummary
from tgis_bench.machine import MachineInfo


def machine_table(m: MachineInfo, threads_of: str = "") -> list[str]:
    """The machine a report's figures came from: CPU and its flags, GPU, driver, versions.
    `threads_of` says whose torch threads are counted (e.g. "client process: ")."""
    return [
        "| | |",
        "|---|---|",
        f"| CPU | {m.cpu} |",
        f"| Cores | {m.cores} |",
        *([f"| CPU flags | {m.cpu_flags} |"] if m.cpu_flags else []),
        *([f"| GPU | {m.gpu} |"] if m.gpu else []),
        *(
            [f"| GPU driver | {m.gpu_driver or 'unknown'} |", f"| CUDA (torch's) | {m.cuda} |"]
            if m.gpu
            else []
        ),
        f"| torch | {m.torch} ({threads_of}{m.torch_threads} threads) |",
        f"| transformers | {m.transformers} |",
        f"| Python | {m.python} |",
        f"| System | {m.system} |",
    ]


def ms(value: float) -> str:
    return f"{value * 1000:.1f}"


def ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def percentile_cells(values: Percentiles | None) -> list[str]:
    return [ms(values.p50), ms(values.p90), ms(values.p99)] if values else ["n/a"] * 3


def _share(run: RunSummary) -> str:
    share = run.next_token_share
    return f"{share.tokproc_share:.1%}" if share else "n/a"


def _batch(run: RunSummary) -> str:
    share = run.next_token_share
    return f"{share.mean_batch_size:.1f}" if share and share.mean_batch_size is not None else "n/a"


def run_table(runs: Sequence[RunSummary]) -> list[str]:
    """One row per concurrency level: throughput, TTFT and ITL percentiles (ms), the step split."""
    header = (
        "| Concurrency | Tokens/s | Requests/s | TTFT p50 | TTFT p90 | TTFT p99 "
        "| ITL p50 | ITL p90 | ITL p99 | Mean decode batch | Token processing share |"
    )
    lines = [header, "|" + "---:|" * 11]
    for run in sorted(runs, key=lambda r: r.concurrency):
        cells = [
            str(run.concurrency),
            f"{run.tokens_per_second:.1f}",
            f"{run.requests_per_second:.2f}",
            *percentile_cells(run.ttft),
            *percentile_cells(run.inter_token),
            _batch(run),
            _share(run),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
