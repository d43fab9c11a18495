"""`tgis-bench`: one subcommand per tool, each given the arguments after its name (`--help` for its flags)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tgis.logs import configure_logging

Tool = Callable[[Sequence[str]], int]


# Each tool imports its module only when run: `tgis-bench --help` loads neither torch nor transformers.
def _run(argv: Sequence[str]) -> int:
    from tgis_bench.load.cli import main as run

    return run(argv)


def _soak(argv: Sequence[str]) -> int:
    from tgis_bench.soak.cli import main as soak

    return soak(argv)


def _build_model(argv: Sequence[str]) -> int:
    from tgis_bench.models.cli import main as build_model

    return build_model(argv)


def _profile_step(argv: Sequence[str]) -> int:
    from tgis_bench.baselines.step_profile import main as profile_step

    return profile_step(list(argv))


def _compare_runs(argv: Sequence[str]) -> int:
    from tgis_bench.compare.runs import main as compare_runs

    return compare_runs(list(argv))


def _paired_runs(argv: Sequence[str]) -> int:
    from tgis_bench.compare.paired import main as paired_runs

    return paired_runs(argv)


def _quality(argv: Sequence[str]) -> int:
    from tgis_bench.quality.cli import main as quality

    return quality(argv)


def _beams(argv: Sequence[str]) -> int:
    from tgis_bench.beams.cli import main as beams

    return beams(argv)


# name → (help, tool)
COMMANDS: dict[str, tuple[str, Tool]] = {
    "run": ("Benchmark a running server: a concurrency sweep, with in-process baselines and peers", _run),
    "soak": ("Soak a server at a share of its saturation, reported per window, with verdicts", _soak),
    "build-model": (
        "Build (once) a benchmark model and print its path (--shape: gpt2-small, llama-1b, llama-tiny)",
        _build_model,
    ),
    "profile-step": (
        "Where a lone stream's decode step goes: the paged step at batch 1, timed and profiled",
        _profile_step,
    ),
    "compare-runs": (
        "Benchmark runs of one workload side by side (e.g. speculation off against on)",
        _compare_runs,
    ),
    "quality": (
        "Perplexity and top-1 agreement of served configurations, teacher-forced (e.g. quantized)",
        _quality,
    ),
    "beams": ("Beam search against greedy decoding on a running server, at each concurrency", _beams),
    "paired-runs": (
        "Served configurations compared in many short alternating rounds, with a confidence interval",
        _paired_runs,
    ),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tgis-bench",
        description="Benchmark, soak and compare tgis servers (`tgis-bench COMMAND --help` for its flags).",
    )
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (description, _) in COMMANDS.items():
        commands.add_parser(name, help=description, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    configure_logging()
    return COMMANDS[args.command][1](rest)
