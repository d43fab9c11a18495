"""Benchmark runs of one workload set side by side: a baseline configuration against others (speculation off
against on, before against after a change), read from the runs' results.json, written as one markdown page.

`tgis-bench compare-runs --baseline off=DIR --run ngram=DIR [--run ...] --out FILE`

On a machine whose speed drifts between minutes, one run of each configuration compares spells as much as
configurations. Each NAME=DIR may then list several rounds, NAME=DIR1,DIR2,...: the i-th directory of every
configuration is one round, run in turn with the others' i-th. A cell shows the median over the rounds of
tokens/s, of ITL p50 and of each round's ratio to the baseline's run in the same round, with the ratios'
range.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class NamedRun:
    """One configuration's benchmark rounds (each a results.json), under the name the comparison gives it."""

    name: str
    rounds: list[dict[str, Any]]

    @property
    def results(self) -> dict[str, Any]:
        """The first round's results: machine, model and workload, which every round shares."""
        return self.rounds[0]

    def levels(self, concurrency: int) -> list[dict[str, Any] | None]:
        """Each round's run at this concurrency (None where a round did not run it)."""
        return [
            next((run for run in results["runs"] if run["concurrency"] == concurrency), None)
            for results in self.rounds
        ]


def _named(text: str) -> tuple[str, list[Path]]:
    name, sep, directories = text.partition("=")
    paths = [Path(directory) for directory in directories.split(",") if directory]
    if not sep or not name or not paths:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR or NAME=DIR1,DIR2,..., got {text!r}")
    return name, paths


def load(name: str, directories: list[Path]) -> NamedRun:
    return NamedRun(name, [json.loads((directory / "results.json").read_text()) for directory in directories])


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.1f}" if seconds is not None else "—"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _itl_p50(levels: list[dict[str, Any] | None]) -> float | None:
    return _median([level["inter_token"]["p50"] for level in levels if level and level.get("inter_token")])


def _rate(levels: list[dict[str, Any] | None]) -> float | None:
    return _median([level["tokens_per_second"] for level in levels if level])


def _ratio(levels: list[dict[str, Any] | None], base_levels: list[dict[str, Any] | None]) -> str:
    """Median of the rounds' ratios to the baseline's run of the same round, with their range."""
    ratios = [
        level["tokens_per_second"] / base["tokens_per_second"]
        for level, base in zip(levels, base_levels, strict=True)
        if level and base and base["tokens_per_second"]
    ]
    if not ratios:
        return ""
    spread = f", {min(ratios):.2f}–{max(ratios):.2f}" if len(ratios) > 1 else ""
    return f" (×{statistics.median(ratios):.2f}{spread})"


def _throughput(levels: list[dict[str, Any] | None], base_levels: list[dict[str, Any] | None]) -> str:
    """A configuration's median tokens/s with its ratio to the baseline ("—" where it did not run)."""
    rate = _rate(levels)
    return "—" if rate is None else f"{rate:.1f}{_ratio(levels, base_levels)}"


def _speculation(levels: list[dict[str, Any] | None]) -> str:
    """Acceptance and tokens per speculating step, averaged over the rounds that speculated."""
    specs = [level["speculation"] for level in levels if level and level.get("speculation")]
    if not specs:
        return "—"
    acceptance = statistics.fmean(spec["acceptance"] for spec in specs)
    return f"{acceptance:.0%}, {statistics.fmean(spec['tokens_per_step'] for spec in specs):.2f}"


def _speculated(run: NamedRun) -> bool:
    return any(level.get("speculation") for results in run.rounds for level in results["runs"])


def comparison_lines(baseline: NamedRun, others: list[NamedRun]) -> list[str]:
    """Per concurrency: each configuration's tokens/s with its ratio to the baseline, ITL p50, and the
    acceptance and tokens per speculating step of the runs that speculated."""
    speculated = [_speculated(o) for o in others]
    speculating = [o for o, spec in zip(others, speculated, strict=True) if spec]
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
        base_levels = baseline.levels(concurrency)
        levels = [o.levels(concurrency) for o in others]
        base_rate = _rate(base_levels)
        cells = [
            str(concurrency),
            f"{base_rate:.1f}" if base_rate is not None else "—",
            *(_throughput(level, base_levels) for level in levels),
            _ms(_itl_p50(base_levels)),
            *(_ms(_itl_p50(level)) for level in levels),
            *(_speculation(level) for level, spec in zip(levels, speculated, strict=True) if spec),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def mismatched_workloads(baseline: NamedRun, others: list[NamedRun]) -> list[str]:
    """The runs whose workload fingerprint differs from the baseline's (they did not send the same work)."""
    expected = baseline.results["workload"]["fingerprint"]
    return [
        run.name
        for run in [baseline, *others]
        if any(results["workload"]["fingerprint"] != expected for results in run.rounds)
    ]


def mismatched_rounds(baseline: NamedRun, others: list[NamedRun]) -> list[str]:
    """The configurations with another number of rounds than the baseline (rounds pair up one to one)."""
    return [o.name for o in others if len(o.rounds) != len(baseline.rounds)]


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
            + ")."
            + (
                f" Median of {len(baseline.rounds)} rounds, each running every configuration in turn;"
                " ratios are each round's against the baseline's run in that round, with their range."
                if len(baseline.rounds) > 1
                else ""
            ),
            "",
            *comparison_lines(baseline, others),
            "",
        ]
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tgis-bench compare-runs", description=__doc__)
    p.add_argument(
        "--baseline",
        type=_named,
        required=True,
        help="NAME=DIR of the reference run (NAME=DIR1,DIR2,... for rounds)",
    )
    p.add_argument(
        "--run",
        type=_named,
        action="append",
        required=True,
        help="NAME=DIR or NAME=DIR1,DIR2,..., repeatable",
    )
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
    uneven = mismatched_rounds(baseline, others)
    if uneven:
        p.error(f"not as many rounds as the baseline's {len(baseline.rounds)}: {', '.join(uneven)}")
    text = render(args.title, baseline, others)
    if args.out is None:
        print(text)
    else:
        with args.out.open("a") as out:
            out.write(text + "\n")
    return 0
