"""hf_optimum_ort specifics: export at startup into a cache, reuse of shipped or cached graphs, one device."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest
import torch

from engines import hf_optimum_ort
from engines.base import EngineConfig
from engines.hf_optimum_ort import loading
from tests.engines.driver import Run, prompt_ids, reference_greedy

PROMPT = "The quick brown fox 🦊 jumps over"


def greedy(engine: hf_optimum_ort.OrtEngine, ids: tuple[int, ...]) -> tuple[int, ...]:
    run = Run(engine, frozenset(engine.spec.eos_token_ids))
    run.join({"only": ids})
    run.finish()
    return tuple(run.tokens["only"])


def test_graphs_are_exported_at_startup_into_the_cache_then_reused(model_dirs, tmp_path, monkeypatch):
    model_dir = model_dirs("gpt2")
    assert not list(model_dir.rglob("*.onnx"))
    config = EngineConfig(model_path=model_dir, cache_dir=tmp_path)
    ids = prompt_ids(model_dir, PROMPT)
    assert greedy(hf_optimum_ort.load(config), ids) == reference_greedy(model_dir, ids)
    (exported,) = tmp_path.iterdir()
    assert sorted(p.name for p in exported.iterdir()) == [
        hf_optimum_ort.DECODER,
        hf_optimum_ort.DECODER_WITH_PAST,
    ]

    def no_export(*args: object) -> Path:
        raise AssertionError("the cached export should have been used")

    monkeypatch.setattr(loading, "export", no_export)
    assert greedy(hf_optimum_ort.load(config), ids) == reference_greedy(model_dir, ids)


def test_graphs_shipped_in_the_model_directory_are_loaded_as_they_are(ort_model_dirs, tmp_path, monkeypatch):
    model_dir = ort_model_dirs("t5")  # graphs exported ahead of time into onnx/
    monkeypatch.setattr(loading, "export", lambda *args: pytest.fail("shipped graphs were ignored"))
    engine = hf_optimum_ort.load(EngineConfig(model_path=model_dir, cache_dir=tmp_path))
    ids = prompt_ids(model_dir, PROMPT)
    assert greedy(engine, ids) == reference_greedy(model_dir, ids)
    assert not list(tmp_path.iterdir())


def test_more_than_one_shard_is_refused(model_dirs):
    with pytest.raises(ValueError, match="hf_optimum_ort runs on one device; it cannot use 2 shards"):
        hf_optimum_ort.load(EngineConfig(model_path=model_dirs("gpt2"), num_shards=2))


@pytest.mark.gpu
@pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available(),
    reason="needs onnxruntime with the CUDA provider and a CUDA device",
)
def test_cuda_provider_decodes_like_transformers(model_dirs, tmp_path):
    model_dir = model_dirs("llama")
    engine = hf_optimum_ort.load(
        EngineConfig(model_path=model_dir, cache_dir=tmp_path, device="cuda", dtype="float32")
    )
    assert engine.graphs[hf_optimum_ort.DECODER].session.get_providers()[0] == "CUDAExecutionProvider"
    ids = prompt_ids(model_dir, PROMPT)
    assert greedy(engine, ids) == reference_greedy(model_dir, ids)
