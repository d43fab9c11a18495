"""TGIS's speculator settings: SPECULATOR_REVISION picks the cached revision of a hub-id speculator, and
SPECULATOR_TOP_K_TOKENS_PER_HEAD is checked as TGIS checks it, then warned about by name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.hub_cache import install_in_hub_cache
from tests.fixtures.speculator import write_random_speculator
from tgis.config import Settings
from tgis.errors import StartupError
from tgis.hub import ModelNotFoundError
from tgis.startup import model as startup_model


def load(settings: Settings, cache: Path, model_dir: Path):
    from engines.base import EngineConfig
    from engines.registry import load_engine

    engine = load_engine("hf_transformers", EngineConfig(model_path=model_dir, dtype="float32"))
    return startup_model._speculator(settings, {"HF_HUB_CACHE": str(cache)}, engine.spec)


@pytest.fixture(scope="module")
def cached_speculator(model_dirs, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A speculator for the llama fixture in a hub cache, at revision `v2` only."""
    model_dir = model_dirs("llama")
    speculator = write_random_speculator(tmp_path_factory.mktemp("speculator"), model_dir)
    cache = tmp_path_factory.mktemp("hub")
    install_in_hub_cache(speculator, cache, "acme/llama-accelerator", revision="v2")
    return cache, model_dir


def test_speculator_revision_selects_the_cached_revision(cached_speculator) -> None:
    cache, model_dir = cached_speculator
    settings = Settings(speculator_name="acme/llama-accelerator", speculator_revision="v2")
    assert load(settings, cache, model_dir) is not None
    with pytest.raises(ModelNotFoundError, match="acme/llama-accelerator"):  # main is not in the cache
        load(Settings(speculator_name="acme/llama-accelerator"), cache, model_dir)


def test_top_k_tokens_per_head_is_checked_then_warned_about(
    cached_speculator, caplog: pytest.LogCaptureFixture
) -> None:
    cache, model_dir = cached_speculator
    base: dict[str, Any] = {"speculator_name": "acme/llama-accelerator", "speculator_revision": "v2"}
    with pytest.raises(StartupError, match=r"Length of top_k_tokens_per_head \(\[4, 3\]\) does not match"):
        load(Settings(**base, speculator_top_k_tokens_per_head="4,3"), cache, model_dir)
    with caplog.at_level(logging.WARNING, logger="tgis.startup.model"):
        load(Settings(**base, speculator_top_k_tokens_per_head="4,3,2"), cache, model_dir)
    assert any(m.startswith("SPECULATOR_TOP_K_TOKENS_PER_HEAD=4,3,2 has no effect") for m in caplog.messages)
