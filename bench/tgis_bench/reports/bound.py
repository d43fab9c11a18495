"""Renders the weights-bandwidth bound: how it was measured, the measured decode step against it, and every
concurrency level's throughput and step against the bound's."""

from __future__ import annotations

from tgis_bench.baselines.bound import BoundRow, DecodeBound, bound_rows, decode_step_ratio
from tgis_bench.load.results import BenchmarkResults
from tgis_bench.reports.tables import ms, ratio

GB = 1e9
GIB = 2**30


def bound_lines(results: BenchmarkResults) -> list[str]:
    bound = results.bound
    if bound is None:
        return []
    return [
        "## Weights-bandwidth bound",
        "",
        *_how_lines(bound, results.model.dtype),
        "",
        *_headline(results),
        "",
        "Per concurrency c: the bound's tokens/s is c tokens per bound step (the most a step at batch c "
        "could make); the server's step is its mean decode step (`tgi_batch_inference_*`, forward and "
        "token processing). Milliseconds.",
        "",
        "| Concurrency | Tokens/s | Bound tokens/s | Tokens/s ÷ bound | ITL p50 | ITL p50 ÷ bound step "
        "| Server step | Server step ÷ bound step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_row(row) for row in bound_rows(bound, results.runs)),
        "",
    ]


def _how_lines(bound: DecodeBound, dtype: str) -> list[str]:
    weights, copy = bound.weights, bound.bandwidth
    skipped = ", ".join(f"`{name}`" for name in weights.lookup_tables) or "none"
    return [
        f"A decode step reads every weight matrix whole, the output matrix included: "
        f"{weights.read_parameters / 1e6:.1f}M of the model's {weights.parameters / 1e6:.1f}M parameters, "
        f"{weights.bytes_per_step / GB:.3f} GB in {dtype} ({weights.bytes_per_step / GIB:.3f} GiB). "
        "Left out: the input embedding tables, of which a step reads only the rows of the tokens it feeds "
        f"({skipped}); a tied table is the output matrix and counts. The KV cache a step also reads is not "
        "in the bound.",
        "",
        f"Measured in this run: a copy of {copy.bytes_copied / GIB:.2f} GiB on {copy.device}, "
        f"{len(copy.seconds)} times after a warm-up, each timed with {copy.timer}, moved "
        f"**{copy.bytes_per_second / GB:.1f} GB/s** (the best repetition, counting the bytes read and the "
        f"bytes written; median {copy.median_bytes_per_second / GB:.1f} GB/s). **Bound: "
        f"{bound.step_seconds * 1000:.3f} ms per decode step** at any batch, "
        f"{bound.tokens_per_second(1):.0f} tokens/s at batch 1.",
    ]


def _headline(results: BenchmarkResults) -> list[str]:
    assert results.bound is not None
    step_ratio = decode_step_ratio(results.bound, results.runs)
    if step_ratio is None:
        return ["No concurrency-1 streamed run: no measured decode step to set against the bound."]
    single = next(run for run in results.runs if run.concurrency == 1)
    assert single.inter_token is not None
    return [
        f"**Measured decode step (ITL p50 at concurrency 1): {ms(single.inter_token.p50)} ms, "
        f"{step_ratio:.2f}× the bound.**"
    ]


def _row(row: BoundRow) -> str:
    cells = [
        str(row.concurrency),
        f"{row.tokens_per_second:.1f}",
        f"{row.bound_tokens_per_second:.0f}",
        f"{row.throughput_share:.1%}",
        ms(row.itl_p50) if row.itl_p50 is not None else "n/a",
        ratio(row.itl_ratio),
        ms(row.step_seconds) if row.step_seconds is not None else "n/a",
        ratio(row.step_ratio),
    ]
    return "| " + " | ".join(cells) + " |"


def console_bound_lines(results: BenchmarkResults) -> list[str]:
    bound = results.bound
    if bound is None:
        return []
    step_ratio = decode_step_ratio(bound, results.runs)
    measured = f"; decode step (ITL p50 at concurrency 1) {step_ratio:.2f}× the bound" if step_ratio else ""
    return [
        f"weights-bandwidth bound: {bound.weights.bytes_per_step / GB:.3f} GB per step at "
        f"{bound.bandwidth.bytes_per_second / GB:.1f} GB/s (device copy) = {bound.step_seconds * 1000:.3f} "
        f"ms per step{measured}"
    ]
