"""`convert-to-safetensors`: local `.bin` weights to safetensors, aliases recorded, index rewritten (§10).

torch and safetensors are imported where tensors are handled, so that a run which stops at the
checks (no .bin files, several indexes, existing targets) answers at once.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tgis.model_files import WeightsError, one_line
from tgis.model_files.selection import convertible_bin_files, local_files

if TYPE_CHECKING:
    import torch

NO_BIN_FILES = "No pytorch .bin files found to convert"
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ConversionPlan:
    """Which `.bin` files become which `.safetensors` files, and the index to rewrite if any."""

    model_dir: Path
    sources: list[Path]
    targets: list[Path]
    index: Path | None

    @property
    def index_target(self) -> Path | None:
        return self.model_dir / SAFETENSORS_INDEX if self.index else None

    def existing_targets(self) -> list[Path]:
        return [path for path in [*self.targets, self.index_target] if path is not None and path.exists()]


@dataclass(frozen=True)
class SharedTensorSplit:
    """A state dict made savable: `tensors` share no memory; each dropped alias maps to its kept name."""

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str]


@dataclass(frozen=True)
class ConvertedFile:
    source: Path
    target: Path
    names: list[str]
    aliases: dict[str, str]
    nbytes: int


def safetensors_name(source: Path) -> str:
    """`pytorch_model-00001-of-00002.bin` → `model-00001-of-00002.safetensors`."""
    return f"{source.stem.removeprefix('pytorch_')}.safetensors"


def plan_conversion(model_dir: Path) -> ConversionPlan:
    """Checks the directory before anything is written; raises WeightsError naming what is wrong."""
    indexes = local_files(model_dir, ".bin.index.json")
    if len(indexes) > 1:
        names = ", ".join(path.name for path in indexes)
        raise WeightsError(f"Found more than one .bin.index.json file in {model_dir}: {names}")
    sources = convertible_bin_files(model_dir)
    if not sources:
        raise WeightsError(NO_BIN_FILES)
    index = indexes[0] if indexes else None
    if index is not None:
        _check_index_files(index, {path.name for path in sources})
    targets = [model_dir / safetensors_name(path) for path in sources]
    return ConversionPlan(model_dir, sources, targets, index)


def _check_index_files(index: Path, present: set[str]) -> None:
    for name in sorted(set(_weight_map(index).values())):
        if name not in present:
            raise WeightsError(f"{index.name} lists {name}, which is missing from {index.parent}")


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"Cannot read the weight map of {index}: {one_line(exc)}") from exc
    if not isinstance(weight_map, dict):
        raise WeightsError(f"Cannot read the weight map of {index}: it is not an object")
    return {str(name): str(file) for name, file in weight_map.items()}


def convert_to_safetensors(model_dir: Path) -> list[Path]:
    """Convert every weights `.bin` of `model_dir`; an existing target is reported and nothing is written."""
    plan = plan_conversion(model_dir)
    existing = plan.existing_targets()
    if existing:
        names = ", ".join(path.name for path in existing)
        print(f"Existing .safetensors weights found, remove them first to re-convert: {names}")
        return []
    tied_names = _TiedNames(model_dir)
    converted = []
    for source, target in zip(plan.sources, plan.targets, strict=True):
        print(f"Converting {source.name} to {target.name}")
        converted.append(convert_file(source, target, tied_names))
    written = [item.target for item in converted]
    if plan.index is not None and plan.index_target is not None:
        rewrite_index(plan.index, plan.index_target, converted)
        written.append(plan.index_target)
    return written


def convert_file(source: Path, target: Path, tied_names: Callable[[], Sequence[str]]) -> ConvertedFile:
    """Load on CPU, drop aliases, save, then reload and compare with what was loaded."""
    from safetensors.torch import save_file

    state = load_state_dict(source)
    split = split_shared_tensors(state, tied_names)
    partial = target.with_name(target.name + ".partial")
    save_file(split.tensors, partial, metadata={"format": "pt", **split.aliases})
    try:
        _verify(partial, state, split)
    except WeightsError:
        partial.unlink()
        raise
    partial.replace(target)
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in split.tensors.values())
    return ConvertedFile(source, target, list(split.tensors), split.aliases, nbytes)


def load_state_dict(source: Path) -> dict[str, torch.Tensor]:
    """The tensors of a `.bin` (unwrapping a `state_dict` entry); never unpickles arbitrary objects."""
    import torch

    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for a bad or unsafe pickle
        raise WeightsError(f"Cannot load {source} as plain tensors: {one_line(exc)}") from exc
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping):
        raise WeightsError(f"{source} does not hold a state dict (found {type(loaded).__name__})")
    tensors = {str(name): value for name, value in loaded.items() if isinstance(value, torch.Tensor)}
    skipped = sorted(str(name) for name in loaded if str(name) not in tensors)
    if skipped:
        print(f"Skipping non-tensor entries of {source.name}: {', '.join(skipped)}")
    return tensors


def split_shared_tensors(
    state: Mapping[str, torch.Tensor], tied_names: Callable[[], Sequence[str]]
) -> SharedTensorSplit:
    """Keep one name per aliased tensor (preferring names the architecture does not tie or ignore).

    safetensors cannot store two names over one memory. Exact aliases (same data, shape, strides)
    are dropped and recorded; distinct views of one storage (a slice of a fused matrix) are copied
    so that each keeps its own values. `tied_names` is only called when there is an alias to resolve
    (it imports the model class, which takes seconds).
    """
    import torch

    views: dict[tuple[object, ...], list[str]] = defaultdict(list)
    for name, tensor in state.items():
        views[_view_key(name, tensor)].append(name)
    aliases: dict[str, str] = {}
    for names in views.values():
        if len(names) > 1:
            patterns = tied_names()
            kept, *dropped = sorted(names, key=lambda name: (_matches_any(name, patterns), name))
            aliases.update((name, kept) for name in dropped)
    kept_names = [name for name in state if name not in aliases]
    storage_users: dict[int, int] = defaultdict(int)
    for name in kept_names:
        if state[name].numel():
            storage_users[state[name].untyped_storage().data_ptr()] += 1
    tensors = {}
    for name in kept_names:
        tensor = state[name]
        shared = bool(tensor.numel()) and storage_users[tensor.untyped_storage().data_ptr()] > 1
        tensors[name] = tensor.clone(memory_format=torch.contiguous_format) if shared else tensor.contiguous()
    return SharedTensorSplit(tensors, aliases)


def _view_key(name: str, tensor: torch.Tensor) -> tuple[object, ...]:
    if not tensor.numel():  # empty tensors may report the same null pointer without sharing anything
        return ("empty", name)
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _matches_any(name: str, patterns: Sequence[str]) -> bool:
    # transformers' key lists hold exact names or regular expressions searched within names.
    for pattern in patterns:
        if name == pattern:
            return True
        try:
            if re.search(pattern, name):
                return True
        except re.error:
            continue
    return False


class _TiedNames:
    """Names the model's architectures tie or may miss on load (from config.json), looked up once."""

    def __init__(self, model_dir: Path) -> None:
        self._config = model_dir / "config.json"
        self._names: list[str] | None = None

    def __call__(self) -> list[str]:
        if self._names is None:
            self._names = tied_or_ignored_names(self._config)
        return self._names


def tied_or_ignored_names(config_file: Path) -> list[str]:
    """`_tied_weights_keys` and `_keys_to_ignore_on_load_missing` of the config's architectures."""
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []  # without a readable config, aliases are resolved by name order alone
    import transformers

    names: list[str] = []
    for architecture in architectures:
        try:
            model_class = getattr(transformers, str(architecture), None)
        except Exception:  # a lazily imported modeling file can fail on a missing extra
            model_class = None
        if model_class is None:
            continue
        tied = getattr(model_class, "_tied_weights_keys", None) or []
        # transformers 5 maps tied name → source name; older versions list the tied names.
        names.extend(tied.keys() if isinstance(tied, Mapping) else tied)
        names.extend(getattr(model_class, "_keys_to_ignore_on_load_missing", None) or [])
    return [str(name) for name in names]


def _verify(saved: Path, state: Mapping[str, torch.Tensor], split: SharedTensorSplit) -> None:
    from safetensors.torch import load_file

    reloaded = load_file(saved)
    if set(reloaded) != set(split.tensors):
        raise WeightsError(f"Reloading {saved.name} gave different tensor names than were saved")
    for name, original in state.items():
        stored = reloaded[split.aliases.get(name, name)]
        if not _same(stored, original):
            raise WeightsError(f"Reloading {saved.name} gave different values for tensor {name}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    # NaN never equals itself; a bitwise-identical copy with NaNs is still the same tensor.
    return a.is_floating_point() and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def rewrite_index(index: Path, target: Path, converted: Sequence[ConvertedFile]) -> None:
    """`model.safetensors.index.json`: every saved tensor of the indexed shards → its new file."""
    data = json.loads(index.read_text())
    indexed = set(_weight_map(index).values())
    shards = [item for item in converted if item.source.name in indexed]
    weight_map = {name: item.target.name for item in shards for name in item.names}
    metadata = dict(data.get("metadata") or {})
    metadata["total_size"] = sum(item.nbytes for item in shards)
    target.write_text(
        json.dumps({"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
    )
