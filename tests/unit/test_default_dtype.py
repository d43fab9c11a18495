"""DTYPE's default: bfloat16 on CPUs that compute it natively (when the server asks), float32 elsewhere."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from engines import hf_transformers
from engines.base import EngineConfig
from engines.hf_transformers import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_the_servers_cpu_default_follows_native_bf16(monkeypatch, caplog, native, expected):
    monkeypatch.setattr(hf_transformers, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="engines.hf_transformers"):
        assert resolve_dtype(None, CPU, cpu_bf16=True) == expected
    assert ("bfloat16, since this CPU computes it natively" in caplog.text) is native


def test_explicit_dtype_and_engines_without_the_default_keep_float32(monkeypatch):
    monkeypatch.setattr(hf_transformers, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("float32", CPU, cpu_bf16=True) == torch.float32
    assert resolve_dtype(None, CPU) == torch.float32  # e.g. ONNX Runtime, which has no bf16 CPU kernels
    assert resolve_dtype(None, torch.device("cuda"), cpu_bf16=True) == torch.float16


def test_the_launcher_asks_for_the_native_default(monkeypatch, tmp_path):
    from tgis import app

    seen: dict[str, EngineConfig] = {}
    cpu_engine = SimpleNamespace(spec=SimpleNamespace(device=torch.device("cpu")))
    monkeypatch.setattr(
        app, "load_engine", lambda framework, config: seen.setdefault("config", config) and cpu_engine
    )
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setattr(app, "resolve_model_path", lambda *a, **k: tmp_path)
    monkeypatch.setattr(app.Tokenizer, "load", classmethod(lambda cls, *a, **k: None))
    app.load_model(app.Settings(model_name="x"), {})
    assert seen["config"].cpu_bf16 is True
