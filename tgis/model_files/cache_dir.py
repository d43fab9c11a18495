"""Where the Hugging Face hub cache lives, from the environment (SPEC §9.1)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

HUB_CACHE_VARS = ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE")


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """HF_HUB_CACHE, or its deprecated aliases (which must agree), else $HF_HOME/hub (SPEC §9.1)."""
    given = {name: environ[name] for name in HUB_CACHE_VARS if environ.get(name)}
    names = list(given)
    for other in names[1:]:  # TGIS's launcher names the later variable first
        if given[other] != given[names[0]]:
            raise ValueError(f"{other} and {names[0]} env vars can't be set to different values")
    for deprecated in names:
        if deprecated != "HF_HUB_CACHE":
            logger.warning(f"{deprecated} is deprecated and should not be used. Use HF_HUB_CACHE instead.")
    if given:
        return Path(given[names[0]])
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"
