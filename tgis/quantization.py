"""QUANTIZE: served through transformers' own quantization support, or refused at start with why.

transformers loads a checkpoint whose config.json carries a `quantization_config` by itself; QUANTIZE
then only has to agree with it, and the method's packages and device must be there. This server does
not quantize an unquantized checkpoint at load time, so that case is refused rather than ignored.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

from tgis.config import StartupError

QUANTIZING_ENGINES = ("hf_transformers",)
# Method -> the packages transformers needs for it (any one of each alternative group).
METHOD_PACKAGES: dict[str, tuple[tuple[str, ...], ...]] = {
    "gptq": (("optimum",), ("gptqmodel", "auto_gptq")),
    "awq": (("awq",),),
    "bitsandbytes": (("bitsandbytes",),),
}
PIP_NAMES = {"awq": "autoawq", "auto_gptq": "auto-gptq"}
WHAT_WORKS = (
    "QUANTIZE serves checkpoints already quantized with gptq, awq or bitsandbytes (their config.json "
    "carries quantization_config) on DEPLOYMENT_FRAMEWORK=hf_transformers with CUDA; unset QUANTIZE "
    "to serve the model unquantized"
)


def package_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def check_quantization(
    quantize: str | None,
    *,
    framework: str,
    model_config: Mapping[str, Any],
    cuda: bool,
    installed: Callable[[str], bool] = package_installed,
) -> None:
    """Return when transformers can serve QUANTIZE from this checkpoint as it stands; else StartupError
    saying why and what works. Unset QUANTIZE: the checkpoint's own quantization_config (if any) rules."""
    if quantize is None:
        return
    method = quantize.strip().lower()
    if framework not in QUANTIZING_ENGINES or method not in METHOD_PACKAGES:
        raise StartupError(f"{quantize} quantization not supported by {framework} engine. {WHAT_WORKS}")
    quantization_config = model_config.get("quantization_config") or {}
    checkpoint_method = quantization_config.get("quant_method")
    if checkpoint_method is None:
        raise StartupError(
            f"QUANTIZE={quantize}: the checkpoint has no quantization_config in its config.json, and this "
            f"server does not quantize at load time. Serve a checkpoint quantized with {method} "
            "(e.g. saved by transformers with its quantization config), or unset QUANTIZE"
        )
    if str(checkpoint_method).lower() != method:
        raise StartupError(
            f"QUANTIZE={quantize} but the checkpoint is quantized with {checkpoint_method}: "
            f"set QUANTIZE={checkpoint_method} or leave it unset"
        )
    if not cuda:
        raise StartupError(
            f"Quantization requires CUDA: QUANTIZE={quantize} and no CUDA device is visible. {WHAT_WORKS}"
        )
    for group in METHOD_PACKAGES[method]:
        if not any(installed(name) for name in group):
            names = " or ".join(PIP_NAMES.get(name, name) for name in group)
            raise StartupError(
                f"QUANTIZE={quantize} needs the {names} package, which is not installed "
                f"(pip install {PIP_NAMES.get(group[0], group[0])})"
            )
