"""Benchmark runs of one workload set side by side: a baseline configuration against others (speculation off
against on, before against after a change), read from the runs' results.json, written as one markdown page.

`text-generation-server compare-runs --baseline off=DIR --run ngram=DIR [--run ...] --out FILE`
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class NamedRun:
    """One benchmark's results.json, under the name the comparison gives it."""

    name: str
    results: dict[str, Any]

    def level(self, concurrency: int) -> dict[str, Any] | None:
        return next((run for run in self.results["runs"] if run["concurrency"] == concurrency), None)


def _named(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, Path(directory)


def load(name: str, directory: Path) -> NamedRun:
    return NamedRun(name, json.loads((directory / "results.json").read_text()))


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.1f}" if seconds is not None else "—"


def _itl_p50(level: dict[str, Any] | None) -> float | None:
    return level["inter_token"]["p50"] if level and level.get("inter_token") else None


def _speculation(level: dict[str, Any] | None) -> str:
    spec = level.get("speculation") if level else None
    if not spec:
        return "—"
    return f"{spec['acceptance']:.0%}, {spec['tokens_per_step']:.2f}"


def _speculated(run: NamedRun) -> bool:
    return any(level.get("speculation") for level in run.results["runs"])


def comparison_lines(baseline: NamedRun, others: list[NamedRun]) -> list[str]:
    """Per concurrency: each configuration's tokens/s with its ratio to the baseline, ITL p50, and the
    acceptance and tokens per speculating step of the runs that speculated."""
    speculating = [o for o in others if _speculated(o)]
    headings = [
        "concurrency",
        f"{baseline.name} tok/s",
        *(f"{o.name} tok/s (×{baseline.name})" for o in others),
        f"{baseline.name} ITL p50 ms",
        *(f"{o.name} ITL p50 ms" for o in others),
        *(f"{o.name} acceptance, tokens/step" for o in speculating),
    ]
    lines = ["| " + " | ".join(headings) + " |", "|" + "---:|" * len(headings)]
    for base in baseline.results["runs"]:
        concurrency = base["concurrency"]
        levels = [o.level(concurrency) for o in others]
        base_rate = base["tokens_per_second"]
        throughput = [
            f"{level['tokens_per_second']:.1f} (×{level['tokens_per_second'] / base_rate:.2f})"
            if level
            else "—"
            for level in levels
        ]
        cells = [
            str(concurrency),
            f"{base_rate:.1f}",
            *throughput,
            _ms(_itl_p50(base)),
            *(_ms(_itl_p50(level)) for level in levels),
            *(_speculation(o.level(concurrency)) for o in speculating),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def mismatched_workloads(baseline: NamedRun, others: list[NamedRun]) -> list[str]:
    """The runs whose workload fingerprint differs from the baseline's (they did not send the same work)."""
    expected = baseline.results["workload"]["fingerprint"]
    return [o.name for o in others if o.results["workload"]["fingerprint"] != expected]


def render(title: str, baseline: NamedRun, others: list[NamedRun]) -> str:
    machine = baseline.results["machine"]
    workload = baseline.results["workload"]
    return "\n".join(
        [
            f"## {title}",
            "",
            f"Machine: {machine['cpu']}, {machine['cores']} cores"
            + (f" ({machine['cpu_flags']})" if machine.get("cpu_flags") else "")
            + (f", GPU {machine['gpu']}" if machine.get("gpu") else "")
            + f"; model `{baseline.results['model']['name']}` in {baseline.results['model']['dtype']}; "
            f"workload fingerprint `{workload['fingerprint']}` ({workload['requests']} requests, prompts "
            + (
                f"of a shared {workload['shared_prefix_tokens']}-token prefix and "
                if workload.get("shared_prefix_tokens")
                else ""
            )
            + f"{workload['prompt_tokens']}, new tokens {workload['new_tokens']}"
            + (", input-grounded" if workload.get("grounded") else "")
            + (f", from `{workload['prompt_source']}`" if workload.get("prompt_source") else "")
            + ").",
            "",
            *comparison_lines(baseline, others),
            "",
        ]
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="text-generation-server compare-runs", description=__doc__)
    p.add_argument("--baseline", type=_named, required=True, help="NAME=DIR of the reference run")
    p.add_argument("--run", type=_named, action="append", required=True, help="NAME=DIR, repeatable")
    p.add_argument("--title", default="Runs compared", help="the section's heading")
    p.add_argument("--out", type=Path, help="append the section to this markdown file (default: print it)")
    args = p.parse_args(argv)
    try:
        baseline = load(*args.baseline)
        others = [load(*named) for named in args.run]
    except (OSError, ValueError, KeyError) as error:
        p.error(f"cannot read a run's results.json: {error}")
    mismatched = mismatched_workloads(baseline, others)
    if mismatched:
        p.error(f"not the baseline's workload: {', '.join(mismatched)}")
    text = render(args.title, baseline, others)
    if args.out is None:
        print(text)
    else:
        with args.out.open("a") as out:
            out.write(text + "\n")
    return 0
