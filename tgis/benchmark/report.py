"""Renders benchmark results: the Markdown report, the console summary and the throughput plot."""

from __future__ import annotations

import json
from pathlib import Path

from tgis.benchmark.results import BenchmarkResults, to_json
from tgis.benchmark.stats import Percentiles, RunSummary

PLOT_NAME = "throughput.png"
BASELINE_LABELS = {"sequential": "sequential generate()", "batched": "raw batched decode loop"}


def baseline_label(name: str, batch_size: int) -> str:
    label = BASELINE_LABELS.get(name, name)
    return f"{label} (batch {batch_size})" if name == "batched" else label


def ratio_lines(results: BenchmarkResults) -> list[str]:
    """`server / sequential generate(): 7.1x`, one line per baseline."""
    ratios = results.ratios()
    return [
        f"server / {baseline_label(b.name, b.batch_size)}: {ratios[b.name]:.2f}x" for b in results.baselines
    ]


def _ms(value: float) -> str:
    return f"{value * 1000:.1f}"


def percentile_cells(values: Percentiles | None) -> list[str]:
    return [_ms(values.p50), _ms(values.p90), _ms(values.p99)] if values else ["n/a"] * 3


def _share(run: RunSummary) -> str:
    share = run.next_token_share
    return f"{share.tokproc_share:.1%}" if share else "n/a"


def _batch(run: RunSummary) -> str:
    share = run.next_token_share
    return f"{share.mean_batch_size:.1f}" if share and share.mean_batch_size is not None else "n/a"


def run_table(results: BenchmarkResults, runs: list[RunSummary] | None = None) -> list[str]:
    header = (
        "| Concurrency | Tokens/s | Requests/s | TTFT p50 | TTFT p90 | TTFT p99 "
        "| ITL p50 | ITL p90 | ITL p99 | Mean decode batch | Token processing share |"
    )
    lines = [header, "|" + "---:|" * 11]
    for run in sorted(results.runs if runs is None else runs, key=lambda r: r.concurrency):
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


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def peer_lines(results: BenchmarkResults) -> list[str]:
    """The peer's table and tgis/peer ratios, or a line saying it was not run."""
    if not results.peer_runs:
        return [
            "Not measured in this run: pass `--vllm-python` (a Python with vLLM's CPU build installed) to "
            "run vLLM's OpenAI server on the same model with the same requests.",
        ]
    return [
        f"{results.peer} (OpenAI completions endpoint, streamed, the same token ids, `--dtype "
        f"{results.model.dtype}`, started after the tgis runs on the same machine, tgis idle):",
        "",
        *run_table(results, results.peer_runs),
        "",
        "| Concurrency | tgis / vLLM tokens/s (higher: tgis faster) | tgis / vLLM TTFT p50 "
        "| tgis / vLLM ITL p99 (lower: tgis faster) |",
        "|---:|---:|---:|---:|",
        *(
            f"| {c} | {_ratio(throughput)} | {_ratio(ttft)} | {_ratio(itl)} |"
            for c, throughput, ttft, itl in results.peer_ratios()
        ),
    ]


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


def render_markdown(results: BenchmarkResults) -> str:
    m, shape, w = results.machine, results.model, results.workload
    headline = results.headline
    params = f"{shape.parameters / 1e6:.1f}M parameters" if shape.parameters else "parameters unknown"
    mode = "streaming (`GenerateStream`)" if w.stream else "unary (`Generate`, one input per call)"
    lines = [
        "# tgis benchmark",
        "",
        f"Generated {results.created} by `text-generation-server benchmark` "
        "(`make benchmark-report` regenerates this directory).",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m.cpu} |",
        f"| Cores | {m.cores} |",
        *([f"| GPU | {m.gpu} |"] if m.gpu else []),
        f"| torch | {m.torch} ({m.torch_threads} threads) |",
        f"| transformers | {m.transformers} |",
        f"| Python | {m.python} |",
        f"| System | {m.system} |",
        "",
        "## Model",
        "",
        f"`{shape.name}`: {shape.model_type}, {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.heads} heads, vocabulary {shape.vocab}, {shape.positions} positions, {params}, "
        f"{shape.dtype}, random weights.",
        "",
        "## Workload",
        "",
        f"{w.requests} greedy requests, prompts of "
        + (f"one shared {w.shared_prefix_tokens}-token prefix plus " if w.shared_prefix_tokens else "")
        + f"{w.prompt_tokens.replace(':', '–')} tokens "
        f"({w.prompt_token_total} in all), {w.new_tokens.replace(':', '–')} new tokens each "
        f"(min_new_tokens = max_new_tokens, {w.new_token_total} in all), {mode}, seed {w.seed} "
        f"(workload fingerprint `{w.fingerprint}`). At concurrency c, c clients each send their next request "
        "as soon as their previous one ends. Tokens/s counts every generated token over the wall time of "
        "the whole run; TTFT is time to the first generated token, ITL the gap between successive tokens "
        "(milliseconds).",
        "",
        "## Server",
        "",
        *run_table(results),
        "",
        "## The peer: vLLM",
        "",
        *peer_lines(results),
        "",
    ]
    if results.baselines:
        lines += [
            "## Baselines",
            "",
            "The same requests on the same model directory, in the benchmark process, after the server runs "
            "(the server idle). Only the tokens each request asked for are counted.",
            "",
            "| Baseline | Batch | Tokens/s | Seconds |",
            "|---|---:|---:|---:|",
            *(
                f"| {BASELINE_LABELS.get(b.name, b.name)} | {b.batch_size} | {b.tokens_per_second:.1f} "
                f"| {b.seconds:.1f} |"
                for b in results.baselines
            ),
            "",
            f"## Ratios (server at concurrency {headline.concurrency})",
            "",
            *(f"- {line}" for line in ratio_lines(results)),
            "",
        ]
    if headline.steps:
        lines += [
            f"## Step time at concurrency {headline.concurrency} (the server's own metrics)",
            "",
            "From `tgi_batch_inference_forward_duration` against `tgi_batch_inference_tokproc_duration` "
            "(sampler, detokenizer, stop rules, events), scraped before and after the run.",
            "",
            *_step_lines(headline),
            "",
        ]
    lines += [f"![Throughput against concurrency]({PLOT_NAME})", ""]
    return "\n".join(lines)


def console_report(results: BenchmarkResults) -> str:
    lines = [
        f"Model {results.model.name} ({results.model.model_type}, {results.model.layers} layers, "
        f"hidden {results.model.hidden}); {results.workload.requests} requests, prompts "
        f"{results.workload.prompt_tokens}, new tokens {results.workload.new_tokens}",
        "",
        *run_table(results),
    ]
    if results.peer_runs:
        lines += ["", f"{results.peer}:", *run_table(results, results.peer_runs)]
        lines += [
            f"tgis / vLLM at concurrency {c}: tokens/s {_ratio(t)}, TTFT p50 {_ratio(ttft)}, "
            f"ITL p99 {_ratio(itl)}"
            for c, t, ttft, itl in results.peer_ratios()
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
        peer_runs = sorted(results.peer_runs, key=lambda r: r.concurrency)
        if peer_runs:
            axes.plot(
                [run.concurrency for run in peer_runs],
                [run.tokens_per_second for run in peer_runs],
                marker="s",
                label=results.peer or "peer",
            )
        for style, baseline in zip(("--", ":", "-."), results.baselines, strict=False):
            label = f"{baseline_label(baseline.name, baseline.batch_size)}"
            axes.axhline(baseline.tokens_per_second, linestyle=style, color="gray", label=label)
        axes.set_xscale("log", base=2)
        axes.set_xticks(x, [str(c) for c in x])
        axes.minorticks_off()
        axes.set_xlabel("concurrent requests")
        axes.set_ylabel("generated tokens / s")
        tops = [run.tokens_per_second for run in [*runs, *results.peer_runs]]
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
    """results.json, REPORT.md and throughput.png in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "results.json"
    data.write_text(json.dumps(to_json(results), indent=2) + "\n")
    report = out_dir / "REPORT.md"
    report.write_text(render_markdown(results))
    plot = out_dir / PLOT_NAME
    plot_throughput(results, plot)
    return [data, report, plot]
