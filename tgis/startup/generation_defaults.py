"""The sampling defaults a checkpoint's generation_config.json recommends, for the OpenAI routes."""

from __future__ import annotations

import logging
from pathlib import Path

from engines.common import read_generation_config
from tgis.types import SamplingDefaults

logger = logging.getLogger(__name__)
# What vLLM takes from a generation config (model_config.get_diff_sampling_param), without max_new_tokens:
# a request's length stays the API's own default.
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_path: Path, mode: str = "auto") -> SamplingDefaults:
    """The values generation_config.json sets explicitly (its `to_diff_dict`, so transformers' own
    defaults don't count); none under GENERATION_CONFIG=vllm. Logged once when there are any."""
    if mode != "auto":
        return SamplingDefaults()
    config = read_generation_config(model_path)
    if config is None:
        return SamplingDefaults()
    given = config.to_diff_dict()
    values = {name: given[name] for name in DEFAULTED if given.get(name) is not None}
    defaults = SamplingDefaults(**values)
    if values:
        shown = " ".join(f"{name}={value}" for name, value in values.items())
        logger.info(
            f"generation_config.json sets the OpenAI routes' sampling defaults: {shown} (a request's own "
            "values win; gRPC and TGI REST keep TGIS's defaults; GENERATION_CONFIG=vllm turns this off)"
        )
    return defaults
