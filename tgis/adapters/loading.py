"""Reading one adapter store entry (SPEC §8): raw `.pt` prefixes, PEFT prompt tuning, PEFT LoRA."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

from engines.base import LoraAdapter, PrefixEmbeddings
from tgis.errors import Msg

PEFT_BASENAME = "adapter_model"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PROMPT_EMBEDDINGS_KEY = "prompt_embeddings"
RAW_DECODER, RAW_ENCODER = "decoder.pt", "encoder.pt"
HIDDEN_SIZE_KEYS = ("hidden_size", "n_embd", "d_model")
# Device memory is accounted in blocks of this many bytes, as the CUDA caching allocator hands them out.
ALLOCATION_BLOCK = 512


class AdapterLoadError(Exception):
    """An adapter id that cannot be served; `reason` is the SPEC §8 text (also `str(exc)`)."""

    def __init__(self, reason: str) -> None:
        self.reason = str(reason)
        super().__init__(self.reason)


class AdapterNotFound(AdapterLoadError):
    """The id is valid but names no usable store entry."""


@dataclass(frozen=True)
class PrefixLimits:
    """What a prefix must fit: the model's shape and the largest prefix the server accepts."""

    is_encoder_decoder: bool
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    max_prefix_length: int


@dataclass(frozen=True)
class LoadedEntry:
    """A store entry ready to serve, with the device bytes it is accounted for in the cache."""

    value: PrefixEmbeddings | LoraAdapter
    size_bytes: int


def model_hidden_size(model_config: Mapping[str, Any]) -> int:
    """The embedding width of a model from its config dict (`hidden_size`, `n_embd` or `d_model`)."""
    for key in HIDDEN_SIZE_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    text_config = model_config.get("text_config")
    if isinstance(text_config, Mapping):
        return model_hidden_size(text_config)
    raise ValueError(f"the model config has none of {', '.join(HIDDEN_SIZE_KEYS)}")


def block_bytes(numel: int, element_size: int) -> int:
    """Bytes a tensor occupies, rounded up to whole allocation blocks (SPEC §8 cache size)."""
    return math.ceil(numel * element_size / ALLOCATION_BLOCK) * ALLOCATION_BLOCK


def load_entry(directory: Path, adapter_id: str, limits: PrefixLimits) -> LoadedEntry:
    """Read and validate the store entry in `directory` (already resolved inside the store)."""
    if not directory.is_dir():
        raise AdapterNotFound(Msg.PREFIX_NOT_FOUND.format(id=adapter_id))
    if any(path.is_file() and path.stem == PEFT_BASENAME for path in directory.iterdir()):
        return _load_peft(directory, adapter_id, limits)
    return _load_raw(directory, adapter_id, limits)


def _load_raw(directory: Path, adapter_id: str, limits: PrefixLimits) -> LoadedEntry:
    decoder = _raw_tensor(directory / RAW_DECODER, limits)
    encoder = _raw_tensor(directory / RAW_ENCODER, limits) if limits.is_encoder_decoder else None
    if decoder is None and encoder is None:
        raise AdapterNotFound(Msg.PREFIX_NOT_FOUND.format(id=adapter_id))
    return _prefix_entry(PrefixEmbeddings(decoder=decoder, encoder=encoder))


def _raw_tensor(path: Path, limits: PrefixLimits) -> torch.Tensor | None:
    if not path.is_file():
        return None
    return validate_prefix_tensor(_torch_load(path), limits)


def _load_peft(directory: Path, adapter_id: str, limits: PrefixLimits) -> LoadedEntry:
    config = _peft_config(directory / PEFT_CONFIG)
    # PROMPT_TUNING when there is no config: TGIS read only the weights of PEFT prefixes.
    peft_type = str(config.get("peft_type") or "PROMPT_TUNING")
    if peft_type == "LORA":
        return _load_lora(directory, adapter_id, config, limits)
    if peft_type != "PROMPT_TUNING":
        raise AdapterLoadError(Msg.ADAPTER_TYPE_UNSUPPORTED.format(type=peft_type))
    if limits.is_encoder_decoder:
        raise AdapterLoadError(Msg.PEFT_ENCODER_DECODER)
    weights = _peft_weights(directory, adapter_id)
    embeddings = weights.get(PROMPT_EMBEDDINGS_KEY)
    if embeddings is None:
        raise AdapterLoadError(Msg.PREFIX_TENSOR_INVALID)
    return _prefix_entry(PrefixEmbeddings(decoder=validate_prefix_tensor(embeddings, limits)))


def _peft_config(config_path: Path) -> dict[str, Any]:
    """The adapter's `adapter_config.json`; empty when there is none."""
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(Msg.ADAPTER_CONFIG_INVALID.format(error=exc)) from exc
    if not isinstance(config, dict):
        raise AdapterLoadError(Msg.ADAPTER_CONFIG_INVALID.format(error="not a JSON object"))
    return config


def _peft_weights(directory: Path, adapter_id: str) -> dict[str, Any]:
    for name in PEFT_WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            loaded = _safetensors_load(path) if path.suffix == ".safetensors" else _torch_load(path)
            if not isinstance(loaded, dict):
                raise AdapterLoadError(
                    Msg.ADAPTER_FILE_UNREADABLE.format(file=name, error="not a state dict")
                )
            return loaded
    raise AdapterNotFound(Msg.PREFIX_NOT_FOUND.format(id=adapter_id))


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location=torch.device("cpu"))
    except Exception as exc:  # any unpickling / format error is the file's fault, not the server's
        raise AdapterLoadError(Msg.ADAPTER_FILE_UNREADABLE.format(file=path.name, error=exc)) from exc


def _safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(path, device="cpu")
    except Exception as exc:
        raise AdapterLoadError(Msg.ADAPTER_FILE_UNREADABLE.format(file=path.name, error=exc)) from exc


def validate_prefix_tensor(prefix: Any, limits: PrefixLimits) -> torch.Tensor:
    """The SPEC §8 checks, in TGIS's order; returns the tensor in the model dtype on its device."""
    if not isinstance(prefix, torch.Tensor) or prefix.ndim != 2:
        raise AdapterLoadError(Msg.PREFIX_TENSOR_INVALID)
    length, dim = prefix.shape
    if length == 0 or length > limits.max_prefix_length:
        raise AdapterLoadError(Msg.PREFIX_LENGTH_INVALID.format(length=length))
    if limits.is_encoder_decoder and length % 2 != 0:
        raise AdapterLoadError(Msg.PREFIX_ODD_LENGTH)
    if dim != limits.hidden_size:
        raise AdapterLoadError(Msg.PREFIX_DIM_MISMATCH.format(dim=dim, expected=limits.hidden_size))
    if not bool(torch.isfinite(prefix).all()):
        raise AdapterLoadError(Msg.PREFIX_NON_FINITE)
    converted = prefix.detach().to(limits.dtype)
    if not bool(torch.isfinite(converted).all()):
        raise AdapterLoadError(Msg.PREFIX_NON_FINITE_AFTER_CAST.format(src=prefix.dtype, dst=limits.dtype))
    return converted.to(limits.device).contiguous()


def _prefix_entry(prefix: PrefixEmbeddings) -> LoadedEntry:
    tensors = [t for t in (prefix.decoder, prefix.encoder) if t is not None]
    return LoadedEntry(prefix, sum(block_bytes(t.numel(), t.element_size()) for t in tensors))


def _load_lora(
    directory: Path, adapter_id: str, config: Mapping[str, Any], limits: PrefixLimits
) -> LoadedEntry:
    """Validate a LoRA adapter without applying it; the engine loads it onto the model itself.

    It is accounted at the model dtype, the form in which the engine keeps it on the device."""
    target_modules = _lora_target_modules(config)
    weights = _peft_weights(directory, adapter_id)
    element_size = torch.empty((), dtype=limits.dtype).element_size()
    size = 0
    lora_a = {key: t for key, t in weights.items() if ".lora_A." in key}
    if not lora_a:
        raise AdapterLoadError(Msg.LORA_INVALID.format(detail="no lora_A weights"))
    for key, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise AdapterLoadError(Msg.LORA_INVALID.format(detail=f"{key} is not a tensor"))
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterLoadError(Msg.LORA_INVALID.format(detail=f"{key} has non-finite elements"))
        size += block_bytes(tensor.numel(), element_size)
    for key, a in lora_a.items():
        _check_lora_pair(key, a, weights.get(key.replace(".lora_A.", ".lora_B.")), target_modules)
    return LoadedEntry(LoraAdapter(adapter_id=adapter_id, path=directory), size)


def _lora_target_modules(config: Mapping[str, Any]) -> frozenset[str] | None:
    """The module names a LoRA config targets; None when it gives a pattern (nothing to check)."""
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterLoadError(Msg.ADAPTER_CONFIG_INVALID.format(error=f"LoRA rank r={rank!r}"))
    targets = config.get("target_modules")
    if isinstance(targets, list) and all(isinstance(name, str) for name in targets):
        return frozenset(targets)
    return None


def _check_lora_pair(
    key: str, a: torch.Tensor, b: torch.Tensor | None, target_modules: frozenset[str] | None
) -> None:
    module = key.split(".lora_A.")[0]
    if b is None or a.ndim < 2 or b.ndim < 2 or a.shape[0] != b.shape[1]:
        raise AdapterLoadError(
            Msg.LORA_INVALID.format(detail=f"lora_A/lora_B shapes of {module} do not pair")
        )
    if target_modules is not None and not any(
        module == name or module.endswith("." + name) for name in target_modules
    ):
        raise AdapterLoadError(Msg.LORA_INVALID.format(detail=f"{module} is not a target module"))
