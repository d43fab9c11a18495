"""Renders the in-process measurements of a run: the baselines with the server's ratios to them, and the
torch-alone decode step."""

from __future__ import annotations

from tgis_bench.baselines.common import BASELINE_LABELS
from tgis_bench.baselines.decode_floor import WARMUP_STEPS, DecodeFloorResult
from tgis_bench.load.results import BenchmarkResults
from tgis_bench.reports.tables import ms, ratio


def baseline_label(name: str, batch_size: int) -> str:
    label = BASELINE_LABELS.get(name, name)
    return f"{label} (batch {batch_size})" if batch_size > 1 else label


def ratio_lines(results: BenchmarkResults) -> list[str]:
    """`server / sequential generate(): 7.1x`, one line per baseline."""
    ratios = results.ratios()
    return [
        f"server / {baseline_label(b.name, b.batch_size)}: {ratios[b.name]:.2f}x" for b in results.baselines
    ]


def baseline_lines(results: BenchmarkResults) -> list[str]:
    if not results.baselines and not results.baseline_failures:
        return []
    per_client = results.workload.requests_per_client
    sent = (
        f"the first {per_client} × batch of the requests"
        if per_client
        else "the same requests on the same model directory"
    )
    lines = [
        "## Baselines",
        "",
        f"{sent[0].upper()}{sent[1:]}, in the benchmark process in the server's dtype, after the server "
        "runs (the server idle), each after an untimed warm-up (a compiled one's on its first full batch, "
        "so its compile is not timed). Only the tokens each request asked for are counted.",
        "",
        "| Baseline | Batch | Tokens/s | Seconds | How |",
        "|---|---:|---:|---:|---|",
        *(
            f"| {BASELINE_LABELS.get(b.name, b.name)} | {b.batch_size} | {b.tokens_per_second:.1f} "
            f"| {b.seconds:.1f} | {b.note} |"
            for b in results.baselines
        ),
        "",
        *(f"- {failure}" for failure in results.baseline_failures),
    ]
    if results.baseline_failures:
        lines.append("")
    if results.baselines:
        lines += [
            f"## Ratios (server at concurrency {results.headline.concurrency})",
            "",
            *(f"- {line}" for line in ratio_lines(results)),
        ]
    return [*lines, ""]


def floor_lines(results: BenchmarkResults) -> list[str]:
    """The torch-alone decode step per batch size, beside the server's ITL p50 at that concurrency."""
    if not results.decode_floor:
        return []
    first = results.decode_floor[0]
    itl = {run.concurrency: run.inter_token.p50 for run in results.runs if run.inter_token}
    lines = [
        "## Torch-alone decode step",
        "",
        f"transformers' forward on a static cache, {first.note}, then argmax, and nothing else: the floor "
        f"under any server's decode step on this model. After {first.prompt_tokens}-token prompts, "
        f"{WARMUP_STEPS} untimed steps, then {first.steps} steps each timed alone ({first.timer}). "
        "Milliseconds per step.",
        "",
        "| Batch | p50 | p90 | p99 | Tokens/s (batch ÷ p50) | Server ITL p50 at that concurrency "
        "| Server ÷ floor |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_floor_row(floor, itl.get(floor.batch_size)) for floor in results.decode_floor]
    return [*lines, ""]


def _floor_row(floor: DecodeFloorResult, server_itl: float | None) -> str:
    cells = [
        str(floor.batch_size),
        ms(floor.step.p50),
        ms(floor.step.p90),
        ms(floor.step.p99),
        f"{floor.tokens_per_second:.1f}",
        ms(server_itl) if server_itl is not None else "n/a",
        ratio(server_itl / floor.step.p50 if server_itl is not None else None),
    ]
    return "| " + " | ".join(cells) + " |"


def console_floor_lines(results: BenchmarkResults) -> list[str]:
    return [
        f"torch-alone decode step at batch {floor.batch_size}: {ms(floor.step.p50)} ms "
        f"(p50 of {floor.steps}; {floor.note})"
        for floor in results.decode_floor
    ]
