"""DEPLOYMENT_FRAMEWORK alone picks the engine; single-device engines hand several shards to hf_custom_tp."""

from __future__ import annotations

import logging

import pytest

from engines import registry
from engines.base import EngineConfig
from tgis.config import Settings


def test_every_documented_framework_has_a_loader():
    assert set(registry.ENGINES) == {"hf_transformers", "hf_custom_tp", "hf_optimum_ort"}


def test_tgis_native_is_read_as_hf_custom_tp():
    assert (
        Settings.model_validate({"deployment_framework": "tgis_native"}).deployment_framework
        == "hf_custom_tp"
    )


def test_hf_transformers_asked_for_several_shards_switches_to_hf_custom_tp(tmp_path, monkeypatch, caplog):
    chosen: list[EngineConfig] = []
    monkeypatch.setitem(registry.ENGINES, "hf_custom_tp", chosen.append)
    with caplog.at_level(logging.WARNING):
        registry.load_engine("hf_transformers", EngineConfig(model_path=tmp_path, num_shards=2))
    assert [config.num_shards for config in chosen] == [2]
    assert "using hf_custom_tp for 2 shards" in caplog.text


def test_unknown_framework_names_the_available_ones(tmp_path):
    with pytest.raises(registry.UnknownEngineError, match="hf_custom_tp, hf_optimum_ort, hf_transformers"):
        registry.load_engine("ibm_fms", EngineConfig(model_path=tmp_path))
