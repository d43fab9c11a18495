"""Explicit map from DEPLOYMENT_FRAMEWORK to the engine loader; the only dispatch point."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from engines import hf_custom_tp, hf_transformers
from engines.base import Engine, EngineConfig
from engines.step import PagedEngine

logger = logging.getLogger(__name__)

Loader = Callable[[EngineConfig], Engine | PagedEngine]


def _load_optimum_ort(config: EngineConfig) -> Engine:
    # onnxruntime is an optional dependency (the `ort` extra): import it only when chosen.
    from engines import hf_optimum_ort

    return hf_optimum_ort.load(config)


ENGINES: dict[str, Loader] = {
    "hf_transformers": hf_transformers.load,
    "hf_custom_tp": hf_custom_tp.load,
    "hf_optimum_ort": _load_optimum_ort,
}

# Engines that run one process on one device; asked for several shards, TGIS switches to its
# tensor-parallel engine (SPEC §7).
SINGLE_DEVICE_FALLBACK = {"hf_transformers": "hf_custom_tp"}


class UnknownEngineError(ValueError):
    pass


def load_engine(framework: str, config: EngineConfig) -> Engine | PagedEngine:
    if config.num_shards > 1 and framework in SINGLE_DEVICE_FALLBACK:
        fallback = SINGLE_DEVICE_FALLBACK[framework]
        logger.warning(
            f"{framework} runs on a single device; using {fallback} for {config.num_shards} shards"
        )
        framework = fallback
    loader = ENGINES.get(framework)
    if loader is None:
        available = ", ".join(sorted(ENGINES))
        raise UnknownEngineError(
            f"DEPLOYMENT_FRAMEWORK {framework} is not available in this build (available: {available})"
        )
    return loader(replace(config))
