"""Which files the weights tools take: extension rules, hub file filters, local weight files (SPEC §10)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

DEFAULT_EXTENSION = ".safetensors"
# Small files that come with the weights when a single weights extension is asked for.
META_EXTENSIONS = (".json", ".py", ".model", ".md")
# Hub files named like training state rather than model weights are never fetched.
HUB_EXCLUDED_WORDS = ("arguments", "args", "training")
# Local .bin files that are not model weights (or are the index) are never converted.
CONVERT_EXCLUDED_WORDS = ("arguments", "args", "training", "optimizer", "scheduler", "index")


def parse_extensions(value: str) -> list[str]:
    """`--extension`: comma-separated; exactly one that is not a metadata extension brings those along."""
    extensions = [part.strip() for part in value.split(",") if part.strip()]
    if len(extensions) == 1 and extensions[0] not in META_EXTENSIONS:
        extensions.extend(META_EXTENSIONS)
    return extensions


def select_hub_files(filenames: Iterable[str], extensions: Sequence[str]) -> list[str]:
    """Top-level repository files ending in a wanted extension, minus training-state files; sorted."""
    return sorted(
        name
        for name in filenames
        if "/" not in name
        and name.endswith(tuple(extensions))
        and not any(word in name for word in HUB_EXCLUDED_WORDS)
    )


def local_files(model_dir: Path, suffix: str) -> list[Path]:
    """Top-level files of `model_dir` whose names end in `suffix`, sorted by name."""
    return sorted(path for path in model_dir.iterdir() if path.name.endswith(suffix) and path.is_file())


def convertible_bin_files(model_dir: Path) -> list[Path]:
    """Local `*.bin` files that hold model weights (not training state), sorted by name."""
    return [
        path
        for path in local_files(model_dir, ".bin")
        if not any(word in path.name for word in CONVERT_EXCLUDED_WORDS)
    ]
