"""The weights subcommands of `text-generation-server`: flags, model lookup and one-line errors (SPEC §10)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tgis.hub import ModelNotFoundError, resolve_model_dir
from tgis.model_files import WeightsError
from tgis.model_files.cache_dir import hub_cache_dir
from tgis.model_files.selection import DEFAULT_EXTENSION, META_EXTENSIONS

DOWNLOAD_WEIGHTS = "download-weights"
CONVERT_TO_SAFETENSORS = "convert-to-safetensors"
CONVERT_TO_FAST_TOKENIZER = "convert-to-fast-tokenizer"
WEIGHTS_COMMANDS = frozenset({DOWNLOAD_WEIGHTS, CONVERT_TO_SAFETENSORS, CONVERT_TO_FAST_TOKENIZER})

MODEL_HELP = "hub id (looked up in the HF cache, HF_HUB_CACHE) or a local model directory"


def add_weights_commands(commands: argparse._SubParsersAction) -> None:
    """Register the three weights subcommands on `text-generation-server`'s subparsers."""
    download = commands.add_parser(
        DOWNLOAD_WEIGHTS, help="Download a model's weights from the Hugging Face Hub into the HF cache"
    )
    download.add_argument("model_name", metavar="MODEL", help="hub id")
    download.add_argument("--revision", help="branch, tag or commit (default main)")
    download.add_argument("--token", help="Hugging Face token (default: HF_TOKEN or the saved login)")
    download.add_argument(
        "--extension",
        default=DEFAULT_EXTENSION,
        help=f"comma-separated file extensions (default {DEFAULT_EXTENSION}); a single one also "
        f"fetches {' '.join(META_EXTENSIONS)} files",
    )
    download.add_argument(
        "--retries",
        type=int,
        default=3,
        help="further attempts after a timeout, dropped connection or 429/5xx, waiting 1, 2, 4… s "
        "(default 3); timeouts: HF_HUB_ETAG_TIMEOUT (connect), HF_HUB_DOWNLOAD_TIMEOUT (read)",
    )
    download.add_argument(
        "--auto-convert",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="convert .bin weights to safetensors when the hub has none, and write tokenizer.json",
    )
    convert = commands.add_parser(
        CONVERT_TO_SAFETENSORS, help="Convert a model's local pytorch .bin weights to safetensors"
    )
    convert.add_argument("model_name", metavar="MODEL", help=MODEL_HELP)
    convert.add_argument("--revision", help="revision in the HF cache (default main)")
    fast = commands.add_parser(
        CONVERT_TO_FAST_TOKENIZER, help="Write a model's tokenizer.json (fast tokenizer) when it has none"
    )
    fast.add_argument("model_name", metavar="MODEL", help=MODEL_HELP)
    fast.add_argument("--revision", help="revision in the HF cache (default main)")
    fast.add_argument("--output-path", type=Path, help="existing directory to save to (default: the model's)")


def run_weights_command(args: argparse.Namespace, unknown: Sequence[str], environ: Mapping[str, str]) -> int:
    """Run one weights subcommand; an operator error is one `ERROR:` line on stderr and exit status 1."""
    if unknown:
        print(f"ERROR: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    try:
        cache_dir = hub_cache_dir(environ)
    except ValueError as exc:  # conflicting HF cache variables
        return _fail(str(exc))
    try:
        _RUNNERS[args.command](args, cache_dir)
    except (WeightsError, ModelNotFoundError) as exc:
        return _fail(str(exc))
    return 0


def _fail(message: str) -> int:
    print(f"ERROR: {message}", file=sys.stderr)
    return 1


def _local_dir(args: argparse.Namespace, cache_dir: Path) -> Path:
    return resolve_model_dir(args.model_name, revision=args.revision or "main", cache_dir=cache_dir)


def _download(args: argparse.Namespace, cache_dir: Path) -> None:
    from tgis.model_files.download import HubModel, download_weights

    model = HubModel(args.model_name, args.revision, args.token, cache_dir, retries=max(args.retries, 0))
    download_weights(model, args.extension, auto_convert=args.auto_convert)


def _convert(args: argparse.Namespace, cache_dir: Path) -> None:
    model_dir = _local_dir(args, cache_dir)  # before importing torch, so a missing model fails fast
    from tgis.model_files.convert import convert_to_safetensors

    convert_to_safetensors(model_dir)


def _fast_tokenizer(args: argparse.Namespace, cache_dir: Path) -> None:
    model_dir = _local_dir(args, cache_dir)
    from tgis.model_files.tokenizer import convert_to_fast_tokenizer

    convert_to_fast_tokenizer(args.model_name, model_dir, args.output_path)


_RUNNERS: dict[str, Callable[[argparse.Namespace, Path], None]] = {
    DOWNLOAD_WEIGHTS: _download,
    CONVERT_TO_SAFETENSORS: _convert,
    CONVERT_TO_FAST_TOKENIZER: _fast_tokenizer,
}
