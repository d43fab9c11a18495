"""Finding model files offline: an absolute directory, or a hub id in the local HF cache (SPEC §10)."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.onnx")


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_path(name: str, *, revision: str, cache_dir: Path) -> Path:
    """Never downloads: the directory itself (absolute, or relative and existing), or the cached
    snapshot of `name` at `revision`."""
    path = Path(name)
    if path.is_absolute() or path.is_dir():
        if not path.is_dir():
            raise ModelNotFoundError(f"Model {name} not found: no such directory")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"Model {name} not found: the directory {path} has no config.json")
        return path if path.is_absolute() else path.resolve()
    snapshot = cached_snapshot(name, revision=revision, cache_dir=cache_dir)
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(
            f"Config file not found in local cache for model {name}, revision {revision}"
        )
    if not any(any(snapshot.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise ModelNotFoundError(f"Weights not found in local cache for model {name}")
    return snapshot


def cached_snapshot(name: str, *, revision: str, cache_dir: Path) -> Path:
    """The snapshot directory of hub id `name` at `revision` in the local cache; never downloads."""
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as exc:
        raise ModelNotFoundError(
            f"Model {name} not found: looked for revision {revision} in the HF cache at {cache_dir} "
            f"(HF_HUB_CACHE); fetch it with `text-generation-server download-weights {name}`"
        ) from exc


def resolve_model_dir(name: str, *, revision: str, cache_dir: Path) -> Path:
    """For the weights tools: an existing directory as is, else the cached snapshot of hub id `name`.

    Unlike `resolve_model_path` it asks for neither config nor weights: converting is how a
    snapshot that only has `.bin` files or no fast tokenizer becomes servable.
    """
    path = Path(name)
    if path.is_dir():
        return path
    if path.is_absolute():
        raise ModelNotFoundError(f"Model {name} not found")
    return cached_snapshot(name, revision=revision, cache_dir=cache_dir)
