"""CUDA_PROCESS_MEMORY_FRACTION reaches torch's allocator on CUDA (monkeypatched: no GPU here)."""

from __future__ import annotations

import pytest
import torch

from tgis.startup import cuda_memory


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, torch.device]]:
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    return calls


def test_fraction_is_applied_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record(monkeypatch)
    cuda_memory.cap_cuda_memory(0.6, torch.device("cuda", 1))
    assert calls == [(0.6, torch.device("cuda", 1))]


def test_nothing_to_cap_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _record(monkeypatch)
    cuda_memory.cap_cuda_memory(0.6, torch.device("cpu"))
    assert calls == []


def test_load_model_applies_the_setting(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """load_model hands the setting and the engine's device to the cap."""
    from types import SimpleNamespace

    from tgis.config import Settings
    from tgis.startup import model as app

    seen: list[tuple[float, torch.device]] = []
    (tmp_path / "config.json").write_text("{}")
    engine = SimpleNamespace(spec=SimpleNamespace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(app, "resolve_model_path", lambda *a, **k: tmp_path)
    monkeypatch.setattr(app, "load_engine", lambda *a, **k: engine)
    monkeypatch.setattr(app.Tokenizer, "load", lambda *a, **k: "tokenizer")
    monkeypatch.setattr(app, "cap_cuda_memory", lambda f, d: seen.append((f, d)))
    app.load_model(Settings(model_name=str(tmp_path), cuda_process_memory_fraction=0.5), {})
    assert seen == [(0.5, torch.device("cuda", 0))]
