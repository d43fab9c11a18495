"""Configurations compared in many short paired rounds, for differences smaller than a machine's drift.

`tgis-bench paired-runs --server off=HOST:PORT --server ngram=HOST:PORT [...] --rounds 20`

A benchmark run of each configuration in turn compares spells of the machine as much as configurations:
on a shared 2-core host two runs of one configuration a minute apart differ by 10-30 %. Here every
round drives each configuration with the same requests at each concurrency level, one after another,
for a few seconds each, and alternates their order (A B C, then C B A) so that a drift within a round
falls on both sides alike. A configuration's figure at a level is the median over the rounds of its
tokens/s divided by the first configuration's in the same round, with a distribution-free confidence
interval for that median (order statistics of the binomial). Serving the first configuration twice
under two names gives the measurement's own noise: its ratio should read 1.00 within its interval.
The interval takes the rounds for independent draws; where the machine's spells last longer than a
round, or favour one side of a pair, they are not, and the second baseline's ratio shows by how much.

Every round sends prompts drawn anew (same lengths and budgets), so that no server answers from a
prefix cache that an earlier round filled.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from tgis_bench.load.client import run_load
from tgis_bench.load.metrics import SpeculationShare, scrape, speculation_share
from tgis_bench.load.workload import BenchRequest, WorkloadSpec
from tgis_bench.machine import MachineInfo
from tgis_bench.reports.files import write_report_files

CONFIDENCE = 0.95

# Per round, each level's (concurrency, requests), in the order they are sent.
Schedule = Sequence[Sequence[tuple[int, Sequence[BenchRequest]]]]


@dataclass(frozen=True)
class Target:
    """A served configuration: its name in the report, its gRPC address, its /metrics (optional)."""

    name: str
    server: str
    metrics_url: str | None = None


@dataclass(frozen=True)
class PairedSample:
    """One configuration's run at one level in one round."""

    round: int
    concurrency: int
    name: str
    tokens_per_second: float
    seconds: float
    speculation: SpeculationShare | None = None


@dataclass(frozen=True)
class RatioSummary:
    """A configuration's tokens/s over the baseline's, per round, at one level."""

    name: str
    concurrency: int
    rounds: int
    median: float
    low: float  # an interval for the median from order statistics (median_interval)
    high: float
    coverage: float  # the probability that the interval holds the true median: CONFIDENCE, or less
    baseline_tokens_per_second: float  # medians over the rounds
    tokens_per_second: float
    acceptance: float | None = None  # over every round's drafts, where it speculated
    tokens_per_step: float | None = None


def round_order(names: Sequence[str], round_number: int) -> list[str]:
    """Forward in even rounds, backward in odd ones: a linear drift across a round favours nobody."""
    return list(names) if round_number % 2 == 0 else list(reversed(names))


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """A distribution-free interval for the median and its coverage: the k-th smallest and k-th largest
    values, k the largest rank that keeps the coverage 1 - 2·P(Binomial(n, 1/2) < k) at `confidence` or
    more. Too few values for that confidence give their whole range, with the coverage it has."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("an interval of no values")
    n = len(ordered)
    below_rank = [0.0]  # below_rank[k] = P(Binomial(n, 1/2) < k)
    for k in range(n // 2 + 1):
        below_rank.append(below_rank[-1] + math.comb(n, k) / 2**n)
    rank = 1
    while rank < (n + 1) // 2 and 1 - 2 * below_rank[rank + 1] >= confidence:
        rank += 1
    return ordered[rank - 1], ordered[n - rank], 1 - 2 * below_rank[rank]


def summarize_ratios(samples: Sequence[PairedSample], baseline: str) -> list[RatioSummary]:
    """Each non-baseline configuration at each level, over the rounds that ran both."""
    by_key = {(s.round, s.concurrency, s.name): s for s in samples}
    names = list(dict.fromkeys(s.name for s in samples if s.name != baseline))
    levels = sorted({s.concurrency for s in samples})
    rounds = sorted({s.round for s in samples})
    summaries = []
    for concurrency in levels:
        for name in names:
            pairs = [
                (by_key[(r, concurrency, name)], by_key[(r, concurrency, baseline)])
                for r in rounds
                if (r, concurrency, name) in by_key and (r, concurrency, baseline) in by_key
            ]
            if not pairs:
                continue
            ratios = [run.tokens_per_second / base.tokens_per_second for run, base in pairs]
            low, high, coverage = median_interval(ratios)
            shares = [run.speculation for run, _ in pairs if run.speculation is not None]
            proposed = sum(share.proposed for share in shares)
            steps = sum(share.speculating_steps for share in shares)
            summaries.append(
                RatioSummary(
                    name=name,
                    concurrency=concurrency,
                    rounds=len(pairs),
                    median=statistics.median(ratios),
                    low=low,
                    high=high,
                    coverage=coverage,
                    baseline_tokens_per_second=statistics.median(b.tokens_per_second for _, b in pairs),
                    tokens_per_second=statistics.median(r.tokens_per_second for r, _ in pairs),
                    acceptance=sum(share.accepted for share in shares) / proposed if proposed else None,
                    tokens_per_step=sum(share.tokens_gained for share in shares) / steps if steps else None,
                )
            )
    return summaries


def render(title: str, baseline: str, summaries: Sequence[RatioSummary], description: str) -> str:
    """A markdown section: one row per level and configuration."""
    lines = [
        f"## {title}",
        "",
        description,
        "",
        f"| concurrency | configuration | rounds | {baseline} tok/s | tok/s | ×{baseline}, median "
        f"| interval (coverage) | acceptance, tokens/step |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for s in summaries:
        speculation = (
            f"{s.acceptance:.0%}, {s.tokens_per_step:.2f}"
            if s.acceptance is not None and s.tokens_per_step is not None
            else "—"
        )
        lines.append(
            f"| {s.concurrency} | {s.name} | {s.rounds} | {s.baseline_tokens_per_second:.1f} "
            f"| {s.tokens_per_second:.1f} | ×{s.median:.3f} "
            f"| {s.low:.3f}–{s.high:.3f} ({s.coverage:.0%}) | {speculation} |"
        )
    return "\n".join(lines) + "\n"


async def drive(
    targets: Sequence[Target],
    rounds: Schedule,
    warmup: Sequence[BenchRequest],
    *,
    stream: bool,
) -> list[PairedSample]:
    """Warm every target up, then each round's levels, every target in turn (`round_order`)."""
    by_name = {target.name: target for target in targets}
    for target in targets:
        if warmup:
            await run_load(target.server, warmup, concurrency=len(warmup), stream=stream, progress=False)
    samples = []
    for number, levels in enumerate(rounds):
        for concurrency, requests in levels:
            for name in round_order(list(by_name), number):
                target = by_name[name]
                before = scrape(target.metrics_url) if target.metrics_url else None
                run = await run_load(
                    target.server, requests, concurrency=concurrency, stream=stream, progress=False
                )
                after = scrape(target.metrics_url) if target.metrics_url else None
                generated = sum(timing.generated_tokens for timing in run.requests)
                samples.append(
                    PairedSample(
                        round=number,
                        concurrency=concurrency,
                        name=name,
                        tokens_per_second=generated / run.seconds,
                        seconds=run.seconds,
                        speculation=speculation_share(before, after) if before and after else None,
                    )
                )
        print(f"round {number + 1}/{len(rounds)} done", file=sys.stderr, flush=True)
    return samples


def round_levels(
    model_dir: Path,
    spec: WorkloadSpec,
    concurrency: Sequence[int],
    rounds: int,
    *,
    warmup: int,
    per_client: int | None,
) -> tuple[list[BenchRequest], Schedule]:
    """The warmup requests and, per round, each level's requests: every round's and level's prompts drawn
    anew from the workload's text (`fresh_prompts`), with the lengths and budgets of the workload's."""
    from transformers import AutoTokenizer

    from tgis_bench.load.workload import build_sweep, build_workload, fresh_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = build_workload(tokenizer, spec)
    sweep = build_sweep(tokenizer, spec, requests, concurrency, warmup=warmup, per_client=per_client)
    schedule = [
        [
            (size, fresh_prompts(tokenizer, spec, sent, f"round-{number}-level-{level}"))
            for level, (size, sent) in enumerate(sweep.levels)
        ]
        for number in range(rounds)
    ]
    return list(sweep.warmup), schedule


def describe(
    machine: MachineInfo,
    model: str,
    spec: WorkloadSpec,
    schedule: Schedule,
) -> str:
    """The paragraph under a section's heading: machine, model, workload, rounds."""
    per_level = ", ".join(f"c={size}: {len(sent)} requests" for size, sent in schedule[0])
    source = f", from `{spec.prompt_source}`" if spec.prompt_source else ""
    return (
        f"Machine: {machine.cpu}, {machine.cores} cores ({machine.cpu_flags}); model `{model}`; "
        f"{len(schedule)} rounds of every configuration in turn, the order alternating; prompts "
        f"{spec.prompt_tokens}, new tokens {spec.new_tokens}{', input-grounded' if spec.grounded else ''}"
        f"{source}; each round sends {per_level}. The interval is the median's distribution-free one "
        f"({CONFIDENCE:.0%} from 6 rounds; fewer give their range, with the coverage it has)."
    )


def _target(text: str) -> Target:
    name, sep, address = text.partition("=")
    server, _, metrics = address.partition(",")
    if not sep or not name or not server:
        raise argparse.ArgumentTypeError(
            f"expected NAME=HOST:PORT or NAME=HOST:PORT,METRICS_URL, got {text!r}"
        )
    return Target(name, server, metrics or None)


def main(argv: Sequence[str]) -> int:
    from tgis_bench.load.cli import _add_workload_flags, _workload
    from tgis_bench.machine import machine_info

    p = argparse.ArgumentParser(
        prog="tgis-bench paired-runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--server",
        type=_target,
        action="append",
        required=True,
        help="NAME=HOST:PORT[,METRICS_URL] of a served configuration, repeatable; the first is the baseline",
    )
    p.add_argument("--model-dir", type=Path, required=True, help="the served model directory")
    p.add_argument("--rounds", type=int, default=20, help="paired rounds (default 20)")
    p.add_argument("--title", default="Paired rounds", help="the report section's heading")
    p.add_argument("--out", type=Path, default=None, help="write results.json and REPORT.md here")
    _add_workload_flags(p)
    args = p.parse_args(argv)
    targets: list[Target] = args.server
    if len(targets) < 2:
        p.error("pair at least two --server configurations")
    if len({t.name for t in targets}) != len(targets):
        p.error("every --server needs a name of its own")
    if args.rounds < 1:
        p.error("--rounds must be positive")
    spec = _workload(p, args)
    warmup, schedule = round_levels(
        args.model_dir,
        spec,
        args.concurrency,
        args.rounds,
        warmup=args.warmup,
        per_client=args.requests_per_client,
    )
    try:
        samples = asyncio.run(drive(targets, schedule, warmup, stream=args.stream))
    except grpc.aio.AioRpcError as error:
        print(f"ERROR: a server answered {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    summaries = summarize_ratios(samples, targets[0].name)
    machine = machine_info()
    description = describe(machine, args.model_dir.name, spec, schedule)
    text = render(args.title, targets[0].name, summaries, description)
    print(text)
    if args.out is not None:
        data = {
            "machine": asdict(machine),
            "model": args.model_dir.name,
            "targets": [t.name for t in targets],
            "summaries": [asdict(s) for s in summaries],
            "samples": [asdict(s) for s in samples],
        }
        written = write_report_files(args.out, data, text)
        print(f"wrote {written[1]}")
    return 0
