"""Renders benchmark results: the Markdown report, the console summary and the throughput plot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tgis_bench.load.results import BenchmarkResults, ModelShape, WorkloadInfo, to_json
from tgis_bench.load.stats import RunSummary
from tgis_bench.machine import MachineInfo
from tgis_bench.reports.baselines import (
    baseline_label,
    baseline_lines,
    console_floor_lines,
    floor_lines,
    ratio_lines,
)
from tgis_bench.reports.bound import bound_lines, console_bound_lines
from tgis_bench.reports.files import write_report_files
from tgis_bench.reports.peers import console_peer_lines, peer_lines
from tgis_bench.reports.tables import machine_table, run_table

PLOT_NAME = "throughput.png"


def _step_lines(run: RunSummary) -> list[str]:
    lines = []
    for method, share in sorted(run.steps.items(), key=lambda item: item[0] != "next_token"):
        batch = f", mean batch {share.mean_batch_size:.1f}" if share.mean_batch_size is not None else ""
        lines.append(
            f"- `{method}`: {share.steps} steps{batch}; forward {share.forward_seconds:.2f} s, "
            f"token processing {share.tokproc_seconds:.2f} s: **{share.tokproc_share:.1%}** of step time."
        )
    inside = sum(s.forward_seconds + s.tokproc_seconds for s in run.steps.values())
    if run.steps:
        outside = max(run.seconds - inside, 0.0)
        lines.append(
            f"- Outside any step (admission, pruning finished rows, idle at the start and end of the run): "
            f"{outside:.2f} s of the run's {run.seconds:.2f} s ({outside / run.seconds:.1%})."
        )
    return lines


def render_markdown(results: BenchmarkResults, plotted: bool = True) -> str:
    """REPORT.md; `plotted` False where matplotlib is missing (the page then says so)."""
    plot = (
        f"![Throughput against concurrency]({PLOT_NAME})"
        if plotted
        else "No throughput plot: matplotlib is not installed here (results.json holds the numbers)."
    )
    lines = [
        "# tgis benchmark",
        "",
        f"Generated {results.created} by `tgis-bench run` "
        f"(`{results.regenerate}` regenerates this directory).",
        "",
        *_machine_lines(results.machine),
        *_model_lines(results.model),
        *_workload_lines(results.workload),
        "## Server",
        "",
        *run_table(results.runs),
        "",
        "## Peers",
        "",
        *peer_lines(results),
        "",
        *bound_lines(results),
        *baseline_lines(results),
        *floor_lines(results),
        *_step_time_lines(results.headline),
        *lone_stream_lines(results.runs),
        *speculation_lines(results.runs),
        plot,
        "",
    ]
    return "\n".join(lines)


def _machine_lines(m: MachineInfo) -> list[str]:
    return ["## Machine", "", *machine_table(m), ""]


def _model_lines(shape: ModelShape) -> list[str]:
    params = f"{shape.parameters / 1e6:.1f}M parameters" if shape.parameters else "parameters unknown"
    mlp = f", MLP width {shape.intermediate}" if shape.intermediate else ""
    kv = f" ({shape.kv_heads} key/value heads)" if shape.kv_heads and shape.kv_heads != shape.heads else ""
    return [
        "## Model",
        "",
        f"`{shape.name}`: {shape.model_type}, {shape.layers} layers, hidden {shape.hidden}{mlp}, "
        f"{shape.heads} heads{kv}, vocabulary {shape.vocab}, {shape.positions} positions, {params}, "
        f"{shape.dtype}, random weights.",
        "",
    ]


def _workload_lines(w: WorkloadInfo) -> list[str]:
    mode = "streaming (`GenerateStream`)" if w.stream else "unary (`Generate`, one input per call)"
    shared = f"one shared {w.shared_prefix_tokens}-token prefix plus " if w.shared_prefix_tokens else ""
    return [
        "## Workload",
        "",
        f"{w.requests} greedy requests, prompts of {shared}{w.prompt_tokens.replace(':', '–')} tokens"
        f"{_prompt_total(w)}{_source(w)}, {w.new_tokens.replace(':', '–')} new tokens "
        f"each (min_new_tokens = max_new_tokens, {w.new_token_total} in all), {mode}, seed {w.seed} "
        f"(workload fingerprint `{w.fingerprint}`). At concurrency c, c clients each send their next request "
        f"as soon as their previous one ends{_per_client(w)}.{_fresh_levels(w)} Tokens/s counts every "
        "generated token over the wall time of the whole run; TTFT is time to the first generated token, "
        "ITL the gap between successive tokens (milliseconds).",
        "",
    ]


def _source(w: WorkloadInfo) -> str:
    source = f", cut from the words of `{w.prompt_source}`" if w.prompt_source else ""
    if w.grounded:
        source += ", input-grounded (each a window of the text, then its first fifth again)"
    return source


def _prompt_total(w: WorkloadInfo) -> str:
    """` (N in all)`, or with long prompts what they are, then the total."""
    if not w.long_prompt_every:
        return f" ({w.prompt_token_total} in all)"
    return (
        f", every {_ordinal(w.long_prompt_every)} request's instead a window of {w.long_prompt_words} words "
        f"of the same text ({w.long_prompt_tokens.replace(':', '–')} tokens; {w.prompt_token_total} in all)"
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _per_client(w: WorkloadInfo) -> str:
    if not w.requests_per_client:
        return ""
    return f", {w.requests_per_client} requests each (the first {w.requests_per_client} × c of the workload)"


def _fresh_levels(w: WorkloadInfo) -> str:
    if not w.fresh_levels:
        return ""
    shared = " after the shared prefix" if w.shared_prefix_tokens else ""
    return (
        f" Each level after the first, and the warmup before them, sends prompts of its own{shared}, as "
        "long and with the same budgets, so that no level is timed on prompts a prefix cache kept from an "
        "earlier one."
    )


def lone_stream_lines(runs: list[RunSummary]) -> list[str]:
    """At concurrency 1 (streamed, with the server's metrics): the client's inter-token gap set against
    the server's own decode step; what is left is spent between steps."""
    run = next((r for r in runs if r.concurrency == 1), None)
    share = run.next_token_share if run is not None else None
    if run is None or share is None or not share.steps or run.inter_token is None:
        return []
    itl, step = run.inter_token.p50 * 1e3, share.mean_step_seconds * 1e3
    forward, tokproc = share.forward_seconds / share.steps * 1e3, share.tokproc_seconds / share.steps * 1e3
    return [
        "## A lone stream (concurrency 1)",
        "",
        f"- Inter-token gap seen by the client: **{itl:.2f} ms** p50.",
        f"- The server's decode step: {step:.2f} ms mean ({forward:.2f} ms scheduling and forward, "
        f"{tokproc:.2f} ms token processing: sampler, detokenizer, stop rules, events).",
        f"- Between steps: {max(itl - step, 0.0):.2f} ms (the event's hand-off to the asyncio thread, the "
        "gRPC message, scheduling the next step).",
        "- Inside the forward: `tgis-bench profile-step` times the same step alone and splits "
        "it by operator (`step-profile.md` beside this report, where the report script wrote one).",
        "",
    ]


def speculation_lines(runs: list[RunSummary]) -> list[str]:
    """What speculative decoding did at each level, from the server's counters; nothing without it."""
    measured = [run for run in runs if run.speculation is not None]
    if not measured:
        return []
    lines = [
        "## Speculative decoding",
        "",
        "| concurrency | draft tokens | accepted | acceptance | tokens per speculating step |",
        "|---:|---:|---:|---:|---:|",
    ]
    for run in measured:
        s = run.speculation
        assert s is not None
        rates = f"{s.acceptance:.1%} | {s.tokens_per_step:.2f}"
        lines.append(f"| {run.concurrency} | {s.proposed} | {s.accepted} | {rates} |")
    return [*lines, ""]


def _step_time_lines(headline: RunSummary) -> list[str]:
    if not headline.steps:
        return []
    return [
        f"## Step time at concurrency {headline.concurrency} (the server's own metrics)",
        "",
        "From `tgi_batch_inference_forward_duration` against `tgi_batch_inference_tokproc_duration` "
        "(sampler, detokenizer, stop rules, events), scraped before and after the run.",
        "",
        *_step_lines(headline),
        "",
    ]


def console_report(results: BenchmarkResults) -> str:
    lines = [
        f"Model {results.model.name} ({results.model.model_type}, {results.model.layers} layers, "
        f"hidden {results.model.hidden}); {results.workload.requests} requests, prompts "
        f"{results.workload.prompt_tokens}, new tokens {results.workload.new_tokens}",
        "",
        *run_table(results.runs),
        *console_peer_lines(results),
        *console_bound_lines(results),
        *console_floor_lines(results),
    ]
    for b in results.baselines:
        lines.append(f"{baseline_label(b.name, b.batch_size)}: {b.tokens_per_second:.1f} tokens/s")
    lines += ratio_lines(results)
    share = results.headline.next_token_share
    if share is not None:
        lines.append(
            f"token processing share of next_token step time at concurrency {results.headline.concurrency}: "
            f"{share.tokproc_share:.1%}"
        )
    return "\n".join(lines)


def plot_throughput(results: BenchmarkResults, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(results.runs, key=lambda r: r.concurrency)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    try:
        x = [run.concurrency for run in runs]
        axes.plot(x, [run.tokens_per_second for run in runs], marker="o", label="tgis server")
        for marker, peer in zip("s^vD<>ph", results.peers, strict=False):
            peer_runs = sorted(peer.runs, key=lambda r: r.concurrency)
            axes.plot(
                [run.concurrency for run in peer_runs],
                [run.tokens_per_second for run in peer_runs],
                marker=marker,
                label=peer.name,
            )
        for style, baseline in zip(("--", ":", "-."), results.baselines, strict=False):
            label = f"{baseline_label(baseline.name, baseline.batch_size)}"
            axes.axhline(baseline.tokens_per_second, linestyle=style, color="gray", label=label)
        axes.set_xscale("log", base=2)
        axes.set_xticks(x, [str(c) for c in x])
        axes.minorticks_off()
        axes.set_xlabel("concurrent requests")
        axes.set_ylabel("generated tokens / s")
        tops = [run.tokens_per_second for run in [*runs, *(r for p in results.peers for r in p.runs)]]
        tops += [b.tokens_per_second for b in results.baselines]
        axes.set_ylim(0, max(tops) * 1.1)
        axes.set_title(f"{results.model.name}: throughput against concurrency")
        axes.grid(True, alpha=0.3)
        axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)


def write_report(results: BenchmarkResults, out_dir: Path) -> list[Path]:
    """results.json, REPORT.md and throughput.png in `out_dir`; the plot only where matplotlib is
    installed (a GPU machine without a registry may not carry it)."""
    plotted = importlib.util.find_spec("matplotlib") is not None
    written = write_report_files(out_dir, to_json(results), render_markdown(results, plotted))
    if not plotted:
        return written
    plot = out_dir / PLOT_NAME
    plot_throughput(results, plot)
    return [*written, plot]
