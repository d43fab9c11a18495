"""Turns an unmodified transformers model into this rank's shard, loading only this rank's weights."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from engines.hf_custom_tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    VocabParallelHead,
    rank_range,
)
from engines.hf_custom_tp.plans import (
    Column,
    Row,
    Rule,
    ShardPlan,
    UnsupportedShardingError,
    VocabEmbedding,
    VocabHead,
)
from engines.hf_custom_tp.weights import REPLICATED, CheckpointReader, Split

_meta_state = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_original_register_parameter = nn.Module.register_parameter


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    if getattr(_meta_state, "active", False) and param is not None and param.device.type != "meta":
        # Already-meta parameters keep their identity, so ties made during __init__ survive.
        param = nn.Parameter(param.to("meta"), requires_grad=False)
    _original_register_parameter(module, name, param)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """In this thread, build modules with parameters on the meta device but real buffers.

    Parameters are replaced by checkpoint slices afterwards, so no full-size weight is ever
    allocated; buffers (rotary tables, masks) are small and computed in __init__, so they stay real.
    The hook is installed only while some thread is inside and acts only in those threads.
    """
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign,assignment]
        _patch_users += 1
    _meta_state.active = True
    try:
        yield
    finally:
        _meta_state.active = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                nn.Module.register_parameter = _original_register_parameter  # type: ignore[method-assign]


def _checkpoint_names(model: nn.Module, keys: Iterator[str]) -> dict[str, str]:
    """Model parameter name → checkpoint key, through transformers' own key renamings.

    transformers 5 renames some keys at load (GPT-NeoX's `embed_out` is `lm_head` in the model).
    Renames are followed; conversions that merge or reshape tensors cannot be read slice by slice.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms = get_model_conversion_mapping(cast(Any, model))
    names: dict[str, str] = {}
    for key in keys:
        name = key
        for transform in transforms:
            renamed, matched = transform.rename_source_key(name)
            if matched is None:
                continue
            if not isinstance(transform, WeightRenaming):
                raise UnsupportedShardingError(
                    f"hf_custom_tp: checkpoint key {key} needs a weight conversion ({matched}); "
                    "it cannot be read slice by slice"
                )
            name = renamed
        names.setdefault(name, key)
    return names


class _Loader:
    """Maps model parameter names to checkpoint keys and reads each distinct slice once."""

    def __init__(self, model: nn.Module, reader: CheckpointReader) -> None:
        self.reader = reader
        self.prefix = getattr(model, "base_model_prefix", "")
        self.ties: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
        self.names = _checkpoint_names(model, reader.keys())
        self._cache: dict[tuple[str, Split, torch.dtype], nn.Parameter] = {}

    def key(self, name: str) -> str:
        seen: set[str] = set()
        while name not in seen:
            seen.add(name)
            # Checkpoints of a base model lack the task model's prefix, and some older ones have it extra.
            for candidate in (name, name.removeprefix(f"{self.prefix}."), f"{self.prefix}.{name}"):
                if candidate in self.names:
                    return self.names[candidate]
            name = self.ties.get(name, name)  # a tied weight is stored under its source's name
        raise UnsupportedShardingError(f"hf_custom_tp: weight {name} not found in the safetensors files")

    def param(self, name: str, split: Split, dtype: torch.dtype) -> nn.Parameter:
        key = self.key(name)
        cache_key = (key, split, dtype)
        if cache_key not in self._cache:
            tensor = self.reader.read(key, split).to(dtype)
            self._cache[cache_key] = nn.Parameter(tensor, requires_grad=False)
        return self._cache[cache_key]


def _dtype(module: nn.Module) -> torch.dtype:
    """The dtype the model chose for this layer (T5 keeps some in float32)."""
    return cast(torch.Tensor, module.weight).dtype


def _bias_split(split: Split) -> Split:
    return Split(dim=0, segments=split.segments)


def _column(name: str, module: nn.Module, rule: Column, loader: _Loader) -> nn.Module:
    split = Split(dim=1 if rule.conv1d else 0, segments=rule.segments, transpose=rule.conv1d)
    dtype = _dtype(module)
    weight = loader.param(f"{name}.weight", split, dtype)
    bias = None if module.bias is None else loader.param(f"{name}.bias", _bias_split(split), dtype)
    return ColumnParallelLinear(weight, bias)


def _row(name: str, module: nn.Module, rule: Row, loader: _Loader, shard: Shard) -> nn.Module:
    split = Split(dim=0 if rule.conv1d else 1, transpose=rule.conv1d)
    dtype = _dtype(module)
    weight = loader.param(f"{name}.weight", split, dtype)
    bias = None if module.bias is None else loader.param(f"{name}.bias", REPLICATED, dtype)
    return RowParallelLinear(weight, bias, shard)


def _vocab_rows(name: str, module: nn.Module, loader: _Loader, shard: Shard) -> tuple[nn.Parameter, int, int]:
    vocab_size = loader.reader.shape(loader.key(f"{name}.weight"))[0]
    weight = loader.param(f"{name}.weight", Split(dim=0), _dtype(module))
    return weight, rank_range(vocab_size, shard)[0], vocab_size


def _replacement(name: str, module: nn.Module, rule: Rule, loader: _Loader, shard: Shard) -> nn.Module:
    if isinstance(rule, Column):
        return _column(name, module, rule, loader)
    if isinstance(rule, Row):
        return _row(name, module, rule, loader, shard)
    if isinstance(rule, VocabEmbedding):
        weight, start, _ = _vocab_rows(name, module, loader, shard)
        return VocabParallelEmbedding(weight, start, shard)
    if isinstance(rule, VocabHead):
        weight, _, vocab_size = _vocab_rows(name, module, loader, shard)
        bias = getattr(module, "bias", None)
        if bias is not None:
            bias = loader.param(f"{name}.bias", Split(dim=0), bias.dtype)
        return VocabParallelHead(weight, bias, vocab_size, shard)
    module.weight = loader.param(f"{name}.weight", rule.split, _dtype(module))
    return module


def _swap_modules(model: nn.Module, replacements: dict[int, nn.Module]) -> None:
    """Point every reference to a replaced module (shared ones included) at its replacement."""
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in replacements:
                parent._modules[child_name] = replacements[id(child)]


def _load_remaining(model: nn.Module, loader: _Loader) -> None:
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                full = f"{module_name}.{param_name}" if module_name else param_name
                module._parameters[param_name] = loader.param(full, REPLICATED, param.dtype)


def shard_model(
    model_class: Any,
    config: Any,
    plan: ShardPlan,
    reader: CheckpointReader,
    shard: Shard,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Build `model_class` from `config` and make it this rank's shard, reading only its slices."""
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with parameters_on_meta():
        model = model_class.from_config(config, dtype=dtype, **kwargs)
    loader = _Loader(model, reader)
    replacements: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        rule = plan.rule_for(name)
        if rule is not None:
            replacements[id(module)] = _replacement(name, module, rule, loader, shard)
    if not any(isinstance(module, RowParallelLinear) for module in replacements.values()):
        raise UnsupportedShardingError(
            f"hf_custom_tp: no layer of {config.model_type} matched its shard plan"
        )
    _swap_modules(model, replacements)
    _load_remaining(model, loader)
    if plan.patch is not None:
        plan.patch(model, config, shard)
    return cast(PreTrainedModel, model.eval())
