"""Renders the peers of a run: how each served and its sweep, then all of them beside tgis with ratios."""

from __future__ import annotations

from tgis_bench.load.results import BenchmarkResults, PeerResult
from tgis_bench.reports.tables import ratio, run_table

NOT_RUN = (
    "Not measured in this run: pass `--vllm-python` (a Python with vLLM's CPU build installed) to run "
    "vLLM's OpenAI server on the same model with the same requests, or `--llamacpp-python` (a Python with "
    "xllamacpp installed) with one `--llamacpp-gguf` per GGUF conversion of the model to run llama.cpp's "
    "server on each."
)


def cpu_line(results: BenchmarkResults) -> str:
    m = results.machine
    flags = f" with {m.cpu_flags}" if m.cpu_flags else ""
    return f"{m.cpu}, {m.cores} cores{flags}"


def peer_lines(results: BenchmarkResults) -> list[str]:
    """Each peer's table, the side-by-side throughput table and the ratios, or why there are none."""
    if not results.peers:
        return [NOT_RUN]
    lines = [
        "Each peer was started after the tgis runs, on the same machine with tgis idle "
        f"({cpu_line(results)}), and sent the same token ids, greedy, exactly as many new tokens as "
        "each request asked for, streamed, at the same concurrency levels, timed as tgis is.",
        "",
    ]
    for peer in results.peers:
        lines += [f"### {peer.name}", "", f"{peer.version}: {peer.settings}.", "", *run_table(peer.runs), ""]
    return [*lines, "### Side by side", "", *side_by_side(results), "", *ratio_table(results)]


def side_by_side(results: BenchmarkResults) -> list[str]:
    """Tokens/s of tgis and of every peer per concurrency level, each peer with tgis/peer."""
    header = ["Concurrency", "tgis tokens/s"]
    for peer in results.peers:
        header += [f"{peer.name} tokens/s", f"tgis / {peer.name}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    by_level = [{run.concurrency: run for run in peer.runs} for peer in results.peers]
    for run in sorted(results.runs, key=lambda r: r.concurrency):
        cells = [str(run.concurrency), f"{run.tokens_per_second:.1f}"]
        for runs in by_level:
            other = runs.get(run.concurrency)
            cells += (
                [f"{other.tokens_per_second:.1f}", ratio(run.tokens_per_second / other.tokens_per_second)]
                if other
                else ["n/a", "n/a"]
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ratio_table(results: BenchmarkResults) -> list[str]:
    lines = [
        "| Concurrency | Peer | tgis / peer tokens/s (higher: tgis faster) | tgis / peer TTFT p50 "
        "| tgis / peer ITL p99 (lower: tgis faster) |",
        "|---:|---|---:|---:|---:|",
    ]
    for peer in results.peers:
        lines += [
            f"| {c} | {peer.name} | {ratio(throughput)} | {ratio(ttft)} | {ratio(itl)} |"
            for c, throughput, ttft, itl in results.peer_ratios(peer)
        ]
    return lines


def console_peer_lines(results: BenchmarkResults) -> list[str]:
    lines: list[str] = []
    for peer in results.peers:
        lines += ["", f"{peer.version}, {peer.name}:", *run_table(peer.runs)]
        lines += [_console_ratio(peer, row) for row in results.peer_ratios(peer)]
    return lines


def _console_ratio(peer: PeerResult, row: tuple[int, float, float | None, float | None]) -> str:
    c, throughput, ttft, itl = row
    return (
        f"tgis / {peer.name} at concurrency {c}: tokens/s {ratio(throughput)}, TTFT p50 {ratio(ttft)}, "
        f"ITL p99 {ratio(itl)}"
    )
