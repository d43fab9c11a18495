"""Explicit map from DEPLOYMENT_FRAMEWORK to the engine loader; the only dispatch point."""

from __future__ import annotations

from collections.abc import Callable

from engines import hf_transformers
from engines.base import Engine, EngineConfig

Loader = Callable[[EngineConfig], Engine]

ENGINES: dict[str, Loader] = {
    "hf_transformers": hf_transformers.load,
}


class UnknownEngineError(ValueError):
    pass


def load_engine(framework: str, config: EngineConfig) -> Engine:
    loader = ENGINES.get(framework)
    if loader is None:
        available = ", ".join(sorted(ENGINES))
        raise UnknownEngineError(
            f"DEPLOYMENT_FRAMEWORK {framework} is not available in this build (available: {available})"
        )
    return loader(config)
