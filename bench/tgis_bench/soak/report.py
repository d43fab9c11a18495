"""The soak's results as one record, and its renderings: REPORT.md, results.json, a console summary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tgis_bench.load.results import ModelShape
from tgis_bench.machine import MachineInfo
from tgis_bench.reports.files import write_report_files
from tgis_bench.reports.tables import machine_table, percentile_cells
from tgis_bench.soak.load import Saturation
from tgis_bench.soak.monitor import Sample
from tgis_bench.soak.windows import KindStats, Verdicts, Window

MIB = 1024 * 1024
# Outcomes that are the normal end of a request; the rest are listed as failures by code.
SUCCESS_CODES = frozenset({"grpc:OK", "http:200"})


@dataclass(frozen=True)
class MixEntry:
    kind: str
    transport: str
    weight: float
    expected: list[str]


@dataclass(frozen=True)
class SoakResults:
    created: str
    machine: MachineInfo
    model: ModelShape
    server: dict[str, Any]  # how it was run: launched or external, its settings, where RSS comes from
    settings: dict[str, Any]  # the soak's own: duration, windows, load, token ranges, limits, seed
    mix: list[MixEntry]
    saturation: Saturation | None  # None when the rate was given
    rate: float  # requests/s the open loop was scheduled at
    seconds: float  # how long requests were sent (shorter than asked if the server exited)
    requests: int
    windows: list[Window]
    kinds: dict[str, KindStats]  # the whole soak
    codes: dict[str, int]
    unexpected: dict[str, int]  # "kind code" → count
    server_failures: dict[str, int]  # the server's tgi_request_failure counters over the soak, by err
    server_log_errors: dict[str, int] | None  # its log's ERROR lines by message; None: not its log to read
    verdicts: Verdicts
    notes: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)  # every server sample (the JSON only)


def to_json(results: SoakResults) -> dict[str, Any]:
    data = asdict(results)
    data["verdicts"]["checks"] = [
        {"target": target, "measured": measured, "passed": ok}
        for target, measured, ok in results.verdicts.checks()
    ]
    data["verdicts"]["passed"] = results.verdicts.passed
    return data


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.0f}"


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def failures_cell(codes: Mapping[str, int]) -> str:
    """Every outcome other than a normal end, `code × n`, or `none`."""
    failed = [f"{code} × {n}" for code, n in codes.items() if code not in SUCCESS_CODES]
    return ", ".join(failed) or "none"


def _mark(ok: bool | None) -> str:
    return "not measured" if ok is None else "pass" if ok else "**FAIL**"


def verdict_lines(results: SoakResults) -> list[str]:
    v = results.verdicts
    lines = ["| Target | Measured | Verdict |", "|---|---:|---|"]
    lines += [f"| {target} | {measured} | {_mark(ok)} |" for target, measured, ok in v.checks()]
    lines.append("")
    if v.rss_peak_growth is not None:
        lines.append(
            f"- Highest RSS after the first window: {v.rss_peak_growth:+.2%} against the RSS at its end."
        )
    if v.kv_drain_seconds is not None:
        lines.append(f"- KV blocks in use reached 0 {v.kv_drain_seconds:.1f} s after the last answer.")
    lines.append(
        f"- Answers outside their kind's expected outcomes: {v.unexpected} (server errors included)."
    )
    lines += ["", f"**Overall: {'PASS' if v.passed else 'FAIL'}**"]
    return lines


def window_table(windows: list[Window]) -> list[str]:
    lines = [
        "| Window (s) | Requests | Req/s | Tokens/s | RSS start / end / max (MiB) | KV used max / end "
        "| Latency p50 / p90 / p99 (ms) | TTFT p50 / p90 / p99 (ms) | Failures by code |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for w in windows:
        cells = [
            f"{w.start:.0f}–{w.end:.0f}",
            str(w.requests),
            f"{w.requests_per_second:.2f}",
            f"{w.tokens_per_second:.1f}",
            f"{_mib(w.rss_start)} / {_mib(w.rss_end)} / {_mib(w.rss_max)}",
            f"{_count(w.kv_used_max)} / {_count(w.kv_used_end)}",
            " / ".join(percentile_cells(w.latency)),
            " / ".join(percentile_cells(w.ttft)),
            failures_cell(w.codes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def kind_table(kinds: Mapping[str, KindStats]) -> list[str]:
    lines = [
        "| Kind | Requests | Latency p50 | p90 | p99 | TTFT p50 | p90 | p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, stats in kinds.items():
        cells = [kind, str(stats.requests), *percentile_cells(stats.latency), *percentile_cells(stats.ttft)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def model_line(shape: ModelShape) -> str:
    params = f"{shape.parameters / 1e6:.1f}M parameters" if shape.parameters else "parameters unknown"
    return (
        f"`{shape.name}`: {shape.model_type}, {shape.layers} layers, hidden {shape.hidden}, {shape.heads} "
        f"heads, vocabulary {shape.vocab}, {params}, {shape.dtype}."
    )


def settings_lines(results: SoakResults) -> list[str]:
    s, server = results.settings, results.server
    sat = results.saturation
    load = (
        f"a closed-loop probe of {sat.concurrency} clients for {sat.seconds:.0f} s answered "
        f"{sat.requests_per_second:.2f} requests/s ({sat.tokens_per_second:.1f} tokens/s, outcomes: "
        f"{failures_cell(sat.codes)} besides OK); the soak sent {s['load']:.0%} of that"
        if sat
        else "the rate was given"
    )
    return [
        f"- Server: {server['how']}. Settings: "
        + (", ".join(f"`{k}={v}`" for k, v in server["settings"].items()) or "not known")
        + f". RSS: {server['rss']}.",
        f"- Adapters: {server['adapters']}. Chat routes: "
        + ("in the mix." if s["chat"] else "left out (the model has no chat template)."),
        f"- Load: {load}: an open loop of Poisson arrivals at {results.rate:.2f} requests/s for "
        f"{s['minutes']:g} min ({results.requests} requests sent in {results.seconds:.0f} s).",
        f"- Requests: prompts of {s['prompt_tokens']} tokens (a pool of {s['prompts']}, seed {s['seed']}), "
        f"{s['new_tokens']} new tokens, greedy; exactly that many except guided and TGI requests (which may "
        f"end at EOS); `time_limit_millis` {s['time_limit_ms']}, client deadline {s['deadline_ms']} ms, "
        f"cancelling kinds stop after half their tokens; any other request over {s['request_timeout']:g} s "
        "counts as a client timeout.",
        f"- Windows of {s['window_seconds']:g} s (a request belongs to the window it was sent in); the "
        f"server sampled every {s['sample_seconds']:g} s; after the load, up to {s['drain_seconds']:g} s "
        "for the KV blocks in use to reach 0.",
    ]


def mix_lines(results: SoakResults) -> list[str]:
    total = sum(entry.weight for entry in results.mix) or 1.0
    lines = ["| Kind | Transport | Share | Expected outcomes |", "|---|---|---:|---|"]
    for e in results.mix:
        expected = ", ".join(f"`{code}`" for code in e.expected)
        lines.append(f"| {e.kind} | {e.transport} | {e.weight / total:.1%} | {expected} |")
    return lines


def outcome_lines(results: SoakResults) -> list[str]:
    codes = ", ".join(f"`{code}` × {n}" for code, n in results.codes.items()) or "none"
    unexpected = ", ".join(f"`{key}` × {n}" for key, n in results.unexpected.items()) or "none"
    server = ", ".join(f"`{err}` × {n}" for err, n in results.server_failures.items() if n) or "none"
    lines = [
        f"- All outcomes: {codes}.",
        f"- Outside their kind's expected outcomes: {unexpected}.",
        f"- The server's own `tgi_request_failure` counters over the soak: {server}.",
    ]
    if results.server_log_errors is None:
        return [*lines, "- The server's log: not read (an external server)."]
    if not results.server_log_errors:
        return [*lines, "- ERROR lines in the server's log (warm-up and probe included): none."]
    lines.append("- ERROR lines in the server's log (warm-up and probe included):")
    return lines + [f"  - `{message}` × {n}" for message, n in results.server_log_errors.items()]


def render_markdown(results: SoakResults) -> str:
    lines = [
        "# tgis soak benchmark",
        "",
        f"Generated {results.created} by `tgis-bench soak --minutes "
        f"{results.settings['minutes']:g}` (`make soak-report` regenerates this directory).",
        "",
        "## Verdicts",
        "",
        *verdict_lines(results),
        "",
        "## Machine",
        "",
        *machine_table(results.machine, threads_of="client process: "),
        "",
        "## Model",
        "",
        model_line(results.model),
        "",
        "## Settings",
        "",
        *settings_lines(results),
        "",
        *mix_lines(results),
        "",
        "## Windows",
        "",
        *window_table(results.windows),
        "",
        "## Outcomes",
        "",
        *outcome_lines(results),
        *(f"- {note}" for note in results.notes),
        "",
        "## Latency by kind (ms), whole soak",
        "",
        *kind_table(results.kinds),
        "",
    ]
    for w in results.windows:
        lines += [
            f"## Latency by kind (ms), window {w.start:.0f}–{w.end:.0f} s",
            "",
            *kind_table(w.kinds),
            "",
        ]
    return "\n".join(lines)


def console_report(results: SoakResults) -> str:
    lines = [*window_table(results.windows), "", *verdict_lines(results)]
    return "\n".join(lines)


def write_report(results: SoakResults, out_dir: Path) -> list[Path]:
    """results.json and REPORT.md in `out_dir`."""
    return write_report_files(out_dir, to_json(results), render_markdown(results))
