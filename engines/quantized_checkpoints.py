"""Checkpoints quantized by others, read into this server's quantized layers (engines/quantized.py) on any
device: GPTQ and AWQ (4-bit, the hub's most common layouts) and compressed-tensors (what llm-compressor
writes: W4A16 `pack-quantized`, W8A16 `int-quantized`). The checkpoint's `quantization_config` says
which; its packed tensors are unpacked here and repacked for the kernels.

Formats (each linear layer `P` of the checkpoint):
- GPTQ (`quant_method: gptq`): `P.qweight` int32 [K/8, N], eight 4-bit values along K per word;
  `P.qzeros` int32 [groups, N/8], eight zero points along N per word (stored minus one in the original
  `gptq` checkpoint format, as they are in `gptq_v2`); `P.scales` [groups, N]; `P.g_idx` [K], each input
  feature's group (act-order checkpoints permute them). w = scale * (q - zero).
- AWQ (`quant_method: awq`, version `gemm`): `P.qweight` int32 [K, N/8] and `P.qzeros` [groups, N/8],
  eight values along N per word in the order 0 2 4 6 1 3 5 7; `P.scales` [groups, N].
- compressed-tensors, 4-bit `pack-quantized`: `P.weight_packed` int32 [N, K/8] (values offset by 8),
  `P.weight_scale` [N, groups], optional `P.weight_zero_point`; 8-bit `int-quantized` or
  `naive-quantized` per channel: `P.weight` int8 [N, K] and `P.weight_scale` [N, 1].
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from torch import nn

from engines.quantized import Int4Weights, install_int4, install_int8, linear_layers

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds
SUPPORTED = "GPTQ (4-bit), AWQ (4-bit, version gemm) and compressed-tensors (W4A16 pack-quantized, W8A16)"


class UnsupportedCheckpointError(ValueError):
    """A quantized checkpoint in a layout this server does not read; the message says what is read."""


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's quantization_config says, as far as loading needs it."""

    method: str  # gptq, awq, compressed-tensors
    bits: int
    group_size: int  # -1: one group per output channel
    detail: dict[str, Any]

    @property
    def describe(self) -> str:
        group = "per channel" if self.group_size <= 0 else f"groups of {self.group_size}"
        return f"{self.method}, {self.bits}-bit, {group}"


def checkpoint_quantization(model_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's quantization, None for an unquantized one; UnsupportedCheckpointError for one in
    a layout not read here."""
    config = model_config.get("quantization_config")
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        bits = int(config.get("bits", config.get("w_bit", 4)))
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        if bits != 4:
            raise UnsupportedCheckpointError(f"{method} with {bits} bits; this server reads {SUPPORTED}")
        if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedCheckpointError(
                f"awq version {config.get('version')}; this server reads {SUPPORTED}"
            )
        return CheckpointQuantization(method, bits, group, dict(config))
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise UnsupportedCheckpointError(f"quant_method {method or 'unset'}; this server reads {SUPPORTED}")


def _compressed_tensors(config: dict[str, Any]) -> CheckpointQuantization:
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedCheckpointError(f"compressed-tensors with {len(groups)} config groups; {SUPPORTED}")
    scheme = groups[0]
    weights, activations = scheme.get("weights") or {}, scheme.get("input_activations")
    if activations:
        raise UnsupportedCheckpointError(
            f"compressed-tensors with quantized activations (W{weights.get('num_bits')}A"
            f"{activations.get('num_bits')}); this server reads weight-only schemes: {SUPPORTED}"
        )
    bits, strategy = int(weights.get("num_bits", 0)), weights.get("strategy")
    fmt = str(config.get("format", "")).lower()
    if bits == 4 and fmt == "pack-quantized" and strategy in ("group", "channel"):
        group = int(weights.get("group_size") or -1) if strategy == "group" else -1
        return CheckpointQuantization("compressed-tensors", 4, group, dict(config))
    if bits == 8 and fmt in ("int-quantized", "naive-quantized") and strategy == "channel":
        if not weights.get("symmetric", True):
            raise UnsupportedCheckpointError(f"compressed-tensors 8-bit asymmetric weights; {SUPPORTED}")
        return CheckpointQuantization("compressed-tensors", 8, -1, dict(config))
    raise UnsupportedCheckpointError(
        f"compressed-tensors format {fmt or 'unset'}, {bits}-bit, strategy {strategy}; "
        f"this server reads {SUPPORTED}"
    )


# ---- loading ---------------------------------------------------------------------------------------------


def load_quantized_checkpoint(
    model_class: Any,
    path: Path,
    model_config: transformers.PretrainedConfig,
    quantization: CheckpointQuantization,
    *,
    dtype: torch.dtype,
    device: torch.device,
    **load_kwargs: Any,
) -> nn.Module:
    """The model with every quantized layer read from the checkpoint's packed tensors. transformers loads
    the rest (its quantizer for the method is bypassed: the config it sees has no quantization_config,
    so the quantized layers start empty and are filled here)."""
    plain = copy.deepcopy(model_config)
    del plain.quantization_config
    with _quiet_transformers():
        model = model_class.from_pretrained(
            path, config=plain, dtype=dtype, local_files_only=True, **load_kwargs
        )
    model.to(device)
    with _tensors(path) as tensors:
        filled = 0
        for name, module in linear_layers(model):
            if _fill(module, name, tensors, quantization, dtype):
                filled += 1
    if not filled:
        raise UnsupportedCheckpointError(
            f"its quantization_config says {quantization.describe}, but no layer's tensors are in that layout"
        )
    logger.info(f"Quantized checkpoint ({quantization.describe}): {filled} linear layers read from it")
    return model


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers reports every packed tensor as unexpected and every quantized weight as missing:
    both are expected here."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


class _Tensors:
    """The checkpoint's safetensors files, read tensor by tensor."""

    def __init__(self, files: list[Any]) -> None:
        self._where = {key: handle for handle in files for key in handle.keys()}  # noqa: SIM118 (not a dict)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)


@contextlib.contextmanager
def _tensors(path: Path) -> Iterator[_Tensors]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedCheckpointError(
            f"no .safetensors files in {path} (quantized checkpoints are read from them)"
        )
    with contextlib.ExitStack() as stack:
        yield _Tensors([stack.enter_context(safe_open(str(f), framework="pt")) for f in files])


def _fill(module: Any, name: str, tensors: _Tensors, q: CheckpointQuantization, dtype: torch.dtype) -> bool:
    """Install the layer's quantized weight if the checkpoint holds it quantized; False if it holds the
    layer dense (an `ignore`d layer, the LM head), which transformers then loaded as usual."""
    if q.method in ("gptq", "awq") and f"{name}.qweight" in tensors:
        unpack = _gptq if q.method == "gptq" else _awq
        install_int4(module, unpack(name, tensors, q), dtype)
    elif q.method == "compressed-tensors" and f"{name}.weight_packed" in tensors:
        install_int4(module, _packed(name, tensors, q), dtype)
    elif q.method == "compressed-tensors" and q.bits == 8 and f"{name}.weight_scale" in tensors:
        weight = tensors[f"{name}.weight"]
        if weight.dtype != torch.int8:  # naive-quantized stores the integers in a float dtype
            weight = weight.round().to(torch.int8)
        install_int8(
            module, weight.to(module.weight.device), tensors[f"{name}.weight_scale"].float().view(-1), dtype
        )
    else:
        return False
    bias_key = f"{name}.bias"
    if module.bias is not None and bias_key in tensors:
        module.bias.data = tensors[bias_key].to(module.bias.device, dtype)
    return True


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit values each (lowest bits first), spread along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., 8] after the packed dimension's index
    values = values.movedim(-1, dim + 1) if dim != words.dim() - 1 else values
    shape = list(words.shape)
    shape[dim] *= 8
    return values.reshape(shape).to(torch.uint8)


def _groups(k: int, group_size: int) -> int:
    return k if group_size <= 0 else group_size


def _gptq(name: str, tensors: _Tensors, q: CheckpointQuantization) -> Int4Weights:
    qweight = tensors[f"{name}.qweight"]  # [K/8, N]
    values = _nibbles(qweight, 0)  # [K, N]
    k = values.shape[0]
    group = _groups(k, q.group_size)
    zeros = _nibbles(tensors[f"{name}.qzeros"], 1).float()  # [G, N]
    if str(q.detail.get("checkpoint_format", "gptq")).lower() == "gptq":
        zeros = zeros + 1  # the original format stores zero - 1
    scales = tensors[f"{name}.scales"].float()  # [G, N]
    g_idx_key = f"{name}.g_idx"
    g_idx = tensors[g_idx_key].long() if g_idx_key in tensors else torch.arange(k) // group
    return _grouped(values.t(), scales.t(), zeros.t(), g_idx, group)


def _awq(name: str, tensors: _Tensors, q: CheckpointQuantization) -> Int4Weights:
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)

    def unpack(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [R, N], undoing the nibble order
        values = _nibbles(words, 1).view(words.shape[0], -1, 8)
        return values[..., inverse].reshape(words.shape[0], -1)

    values = unpack(tensors[f"{name}.qweight"])  # [K, N]
    k = values.shape[0]
    group = _groups(k, q.group_size)
    zeros = unpack(tensors[f"{name}.qzeros"]).float()
    scales = tensors[f"{name}.scales"].float()
    return _grouped(values.t(), scales.t(), zeros.t(), torch.arange(k) // group, group)


def _packed(name: str, tensors: _Tensors, q: CheckpointQuantization) -> Int4Weights:
    values = _nibbles(tensors[f"{name}.weight_packed"], 1)  # [N, K], signed values offset by 8
    k = values.shape[1]
    group = _groups(k, q.group_size)
    scales = tensors[f"{name}.weight_scale"].float()  # [N, G]
    zero_key = f"{name}.weight_zero_point"
    zeros = 8 + (tensors[zero_key].float() if zero_key in tensors else torch.zeros_like(scales))
    g_idx_key = f"{name}.weight_g_idx"
    g_idx = tensors[g_idx_key].long() if g_idx_key in tensors else torch.arange(k) // group
    return _grouped(values, scales, zeros, g_idx, group)


def _grouped(
    values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, group: int
) -> Int4Weights:
    """[N, K] values with each input feature's group given by `g_idx`: when the groups are not
    contiguous runs (act-order), the features are reordered so that they are, and the permutation kept."""
    k = values.shape[1]
    if k % group:
        raise UnsupportedCheckpointError(f"{k} input features do not split into groups of {group}")
    permutation = None
    if not torch.equal(g_idx, torch.arange(k) // group):
        permutation = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[permutation], torch.arange(k) // group):
            raise UnsupportedCheckpointError("groups of unequal sizes in g_idx")
        values = values[:, permutation]
    return Int4Weights(values.contiguous(), scales.contiguous(), zeros.contiguous(), group, permutation)
