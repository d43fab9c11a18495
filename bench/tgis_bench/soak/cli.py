"""`tgis-bench soak --minutes MINUTES`: flags → SoakConfig → REPORT.md and results.json."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tgis_bench.load.cli import length_range_arg
from tgis_bench.load.workload import LengthRange
from tgis_bench.soak.load import SoakError
from tgis_bench.soak.mix import KIND_NAMES, parse_weights
from tgis_bench.soak.report import console_report, write_report
from tgis_bench.soak.run import ExternalServer, SoakConfig, run_soak
from tgis_bench.soak.server import LaunchSettings


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _weights(text: str) -> dict[str, float]:
    try:
        weights = parse_weights(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    unknown = sorted(set(weights) - set(KIND_NAMES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kinds {unknown}; known: {', '.join(KIND_NAMES)}")
    return weights


def _env(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tgis-bench soak",
        description="Soak a server: an open loop of mixed requests (gRPC and HTTP, streams, cancellations, "
        "deadlines, guided decoding, adapters) at a share of its saturation throughput, reported per window: "
        "RSS, latency, failures by code, KV blocks in use; then the verdicts.",
    )
    p.add_argument("--minutes", type=_positive, required=True, help="how long the load runs")
    p.add_argument("--window", type=_positive, default=300.0, help="report window, seconds (default 300)")
    p.add_argument("--sample-every", type=_positive, default=5.0, help="server sampling period, seconds")
    _server_flags(p)
    _load_flags(p)
    p.add_argument("--seed", type=int, default=0, help="prompts, mix and arrival times")
    p.add_argument("--out", type=Path, default=None, help="write results.json and REPORT.md here")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress lines")
    return p


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="the model to serve (or, with --server, the one it serves: its tokenizer builds the prompts); "
        "default the benchmark model (tgis-bench build-model); $(text-generation-server build-demo-model) "
        "is the demo model",
    )
    p.add_argument(
        "--server", default=None, help="soak this running server (gRPC host:port) instead of launching one"
    )
    p.add_argument("--http-url", default=None, help="with --server: its HTTP base URL (http://host:3000)")
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="with --server on this machine: its pid, for RSS and exits",
    )
    p.add_argument("--lora-adapter", default=None, help="with --server: a LoRA adapter id in its store")
    p.add_argument(
        "--prefix-adapter", default=None, help="with --server: a prompt-tuning prefix id in its store"
    )
    p.add_argument("--max-batch-size", type=int, default=16, help="the launched server's MAX_BATCH_SIZE")
    p.add_argument(
        "--server-env",
        type=_env,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="more settings for the launched server (repeatable), e.g. DTYPE=float32",
    )
    p.add_argument("--server-log", type=Path, default=None, help="keep the launched server's output here")


def _load_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", type=_positive, default=0.8, help="share of the saturation throughput")
    p.add_argument("--rate", type=_positive, default=None, help="requests/s; skips the saturation probe")
    p.add_argument("--probe-seconds", type=_positive, default=60.0, help="saturation probe length")
    p.add_argument("--probe-concurrency", type=int, default=None, help="default 2 × the batch size")
    p.add_argument("--prompt-tokens", type=length_range_arg, default=LengthRange(16, 96), help="LOW:HIGH")
    p.add_argument("--new-tokens", type=length_range_arg, default=LengthRange(16, 64), help="LOW:HIGH")
    p.add_argument(
        "--mix",
        type=_weights,
        default={},
        help=f"KIND=WEIGHT,... (0 drops a kind); kinds: {', '.join(KIND_NAMES)}",
    )
    p.add_argument("--time-limit-ms", type=int, default=500, help="grpc_time_limit's time_limit_millis")
    p.add_argument("--deadline-ms", type=int, default=800, help="grpc_deadline's client deadline")
    p.add_argument("--drain-seconds", type=_positive, default=30.0, help="wait for KV blocks to reach 0")


def config_from(args: argparse.Namespace) -> SoakConfig:
    external = None
    if args.server is not None:
        if args.http_url is None:
            raise SystemExit("ERROR: --server needs --http-url (the server's HTTP port serves half the mix)")
        external = ExternalServer(
            args.server, args.http_url, args.server_pid, args.lora_adapter, args.prefix_adapter
        )
    return SoakConfig(
        minutes=args.minutes,
        model_dir=args.model_dir,
        external=external,
        launch=LaunchSettings(max_batch_size=args.max_batch_size, extra=dict(args.server_env)),
        server_log=args.server_log,
        window_seconds=args.window,
        sample_seconds=args.sample_every,
        load=args.load,
        rate=args.rate,
        probe_seconds=args.probe_seconds,
        probe_concurrency=args.probe_concurrency,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        seed=args.seed,
        weights=args.mix,
        time_limit_ms=args.time_limit_ms,
        deadline_ms=args.deadline_ms,
        drain_seconds=args.drain_seconds,
        progress=args.progress,
    )


def main(argv: Sequence[str]) -> int:
    """0 when every verdict passed, 1 when one failed, 2 when the soak could not run."""
    args = parser().parse_args(argv)
    try:
        results = run_soak(config_from(args))
    except (SoakError, RuntimeError) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 2
    print(console_report(results), flush=True)
    if args.out is not None:
        for path in write_report(results, args.out):
            print(f"wrote {path}")
    return 0 if results.verdicts.passed else 1
