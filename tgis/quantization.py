"""QUANTIZE (and TGIS's DTYPE=int8): which quantization a server serves, or a startup error saying why
not and what works. Pure: preflight runs it before torch loads.

- Quantized at load, from any unquantized checkpoint: `int8` (per output channel) and `int4` (groups of
  QUANTIZE_GROUP_SIZE input features; engines/quantized.py). TGI's and TGIS's names map where their
  meaning matches: `eetq` (8-bit weight-only at load) and `bitsandbytes` (8-bit at load, as TGIS
  means it, and as TGIS reads DTYPE=int8) are `int8`.
- A checkpoint quantized by others (its config.json carries `quantization_config`): GPTQ, AWQ and
  compressed-tensors (engines/quantized_checkpoints.py). The checkpoint's config is the source of
  truth; QUANTIZE, if set, has to agree with it: the same method, or `int4`/`int8` for its bit width.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tgis.config import StartupError

AT_LOAD = {"int8": "int8", "int4": "int4", "eetq": "int8", "bitsandbytes": "int8"}
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
QUANTIZING_ENGINES = ("hf_transformers", "hf_custom_tp")
WHAT_WORKS = (
    "QUANTIZE=int8 or int4 quantizes any checkpoint at load (eetq and bitsandbytes mean int8), and "
    "checkpoints quantized with gptq, awq or compressed-tensors are served as they are"
)


def quantization_at_load(
    quantize: str | None,
    *,
    dtype_name: str | None,
    framework: str,
    model_config: Mapping[str, Any] | None,
    pt2_compile: bool = False,
) -> str | None:
    """`int8` or `int4` to quantize at load; None to serve the weights as the checkpoint has them
    (unquantized, or quantized by others); StartupError for anything else, naming what works.
    `model_config` None: the checkpoint is not known yet (the names alone are checked)."""
    method = _method(quantize, dtype_name)
    if method is None:
        return None
    if framework not in QUANTIZING_ENGINES:
        raise StartupError(
            f"{quantize or 'DTYPE=int8'} quantization not supported by {framework} engine. {WHAT_WORKS}"
        )
    if pt2_compile and framework != "hf_transformers":
        raise StartupError(
            f"QUANTIZE={method} with PT2_COMPILE is served by hf_transformers only: unset one of them, "
            f"or serve with hf_transformers"
        )
    checkpoint = _checkpoint_method(model_config)
    if checkpoint is not None and framework != "hf_transformers":
        raise StartupError(
            f"A checkpoint quantized with {checkpoint} is served by hf_transformers (one device); "
            f"{framework} quantizes at load only (QUANTIZE=int8 or int4 on an unquantized checkpoint)"
        )
    if method in CHECKPOINT_METHODS:
        if model_config is not None and checkpoint != method:
            raise StartupError(_needs_checkpoint(method, checkpoint))
        return None
    if method not in AT_LOAD:
        raise StartupError(_unknown(method, framework))
    if checkpoint is not None:
        bits = _checkpoint_bits(model_config or {})
        if AT_LOAD[method] != f"int{bits}":
            raise StartupError(
                f"QUANTIZE={method} contradicts the checkpoint, quantized with {checkpoint} ({bits}-bit): "
                f"set QUANTIZE={checkpoint} or leave it unset"
            )
        return None
    return AT_LOAD[method]


def _method(quantize: str | None, dtype_name: str | None) -> str | None:
    method = quantize.strip().lower() if quantize else None
    if dtype_name == "int8":  # TGIS's launcher: DTYPE=int8 means QUANTIZE=bitsandbytes
        if method not in (None, "bitsandbytes"):
            raise StartupError(f"DTYPE=int8 means QUANTIZE=bitsandbytes, and QUANTIZE={quantize} is set")
        return "bitsandbytes"
    return method


def _checkpoint_method(model_config: Mapping[str, Any] | None) -> str | None:
    config = (model_config or {}).get("quantization_config") or {}
    method = config.get("quant_method")
    return str(method).lower() if method else None


def _checkpoint_bits(model_config: Mapping[str, Any]) -> int:
    config = model_config.get("quantization_config") or {}
    if "bits" in config or "w_bit" in config:
        return int(config.get("bits", config.get("w_bit", 4)))
    for group in (config.get("config_groups") or {}).values():
        return int((group.get("weights") or {}).get("num_bits", 0))
    return 0


def _needs_checkpoint(method: str, checkpoint: str | None) -> str:
    if checkpoint is None:
        return (
            f"QUANTIZE={method} serves a checkpoint quantized with {method} (its config.json carries "
            f"quantization_config), and this one is not quantized: quantize it at load with QUANTIZE=int8 "
            f"or int4, or unset QUANTIZE"
        )
    return (
        f"QUANTIZE={method} but the checkpoint is quantized with {checkpoint}: set QUANTIZE={checkpoint} "
        "or leave it unset"
    )


def _unknown(method: str, framework: str) -> str:
    """The SPEC's refusal, then why and what works."""
    refusal = f"{method} quantization not supported by {framework} engine."
    if method.startswith("bitsandbytes"):
        return (
            f"{refusal} It needs bitsandbytes' 4-bit kernels, which this server does not run: QUANTIZE=int4 "
            f"quantizes to 4 bits on every device. {WHAT_WORKS}"
        )
    return f"{refusal} {WHAT_WORKS}"
