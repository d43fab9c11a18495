"""The dtype and device an engine loads in: bf16 where the CPU runs it natively; CUDA with an index."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from engines import common
from engines.base import EngineConfig
from engines.common import resolve_device, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_the_servers_cpu_default_follows_native_bf16(monkeypatch, caplog, native, expected):
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="engines.common"):
        assert resolve_dtype(None, CPU, cpu_bf16=True) == expected
    assert ("bfloat16, since this CPU computes it natively" in caplog.text) is native


def test_explicit_dtype_and_engines_without_the_default_keep_float32(monkeypatch):
    monkeypatch.setattr(common, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("float32", CPU, cpu_bf16=True) == torch.float32
    assert resolve_dtype(None, CPU) == torch.float32  # e.g. ONNX Runtime, which has no bf16 CPU kernels
    assert resolve_dtype(None, torch.device("cuda"), cpu_bf16=True) == torch.float16


@pytest.mark.parametrize(
    ("saved", "bf16_gpu", "expected"),
    [
        (torch.bfloat16, True, torch.bfloat16),  # a bfloat16 checkpoint keeps its range
        (torch.bfloat16, False, torch.float16),  # ... unless the GPU has no bfloat16 (warned)
        (torch.float16, True, torch.float16),
        (torch.float32, True, torch.float16),  # TGIS's default
        (None, True, torch.float16),
    ],
)
def test_the_cuda_default_is_float16_except_for_bfloat16_checkpoints(monkeypatch, saved, bf16_gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16_gpu)
    assert resolve_dtype(None, torch.device("cuda"), checkpoint=saved) == expected
    assert resolve_dtype("float16", torch.device("cuda"), checkpoint=saved) == torch.float16  # DTYPE wins


def test_a_checkpoints_dtype_is_read_from_its_config():
    import transformers

    assert common.checkpoint_dtype(transformers.LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    assert common.checkpoint_dtype(transformers.LlamaConfig(dtype=torch.float16)) == torch.float16


def test_the_launcher_asks_for_the_native_default(monkeypatch, tmp_path):
    from tgis.config import Settings
    from tgis.startup import model as app

    seen: dict[str, EngineConfig] = {}
    cpu_engine = SimpleNamespace(spec=SimpleNamespace(device=torch.device("cpu")))
    monkeypatch.setattr(
        app, "load_engine", lambda framework, config: seen.setdefault("config", config) and cpu_engine
    )
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setattr(app, "resolve_model_path", lambda *a, **k: tmp_path)
    monkeypatch.setattr(app.Tokenizer, "load", classmethod(lambda cls, *a, **k: None))
    app.load_model(Settings(model_name="x"), {})
    assert seen["config"].cpu_bf16 is True


def test_a_cuda_device_is_always_resolved_to_an_index(monkeypatch):
    """torch.cuda.mem_get_info and set_per_process_memory_fraction refuse `cuda` without an index."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device(None) == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_without_cuda_the_device_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")


@pytest.fixture
def cudnn_attention_flag():
    """torch's process-wide cuDNN-attention switch, restored after the test."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_loading_on_cuda_takes_cudnn_attention_out_of_sdpas_choices(cudnn_attention_flag, caplog):
    torch.backends.cuda.enable_cudnn_sdp(True)
    common.avoid_per_shape_attention_builds(CPU)
    assert torch.backends.cuda.cudnn_sdp_enabled(), "the CPU has no cuDNN: nothing to change"
    with caplog.at_level(logging.INFO, logger="engines.common"):
        common.avoid_per_shape_attention_builds(torch.device("cuda", 0))
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert "cuDNN attention off" in caplog.text
    # Flash and memory-efficient attention stay SDPA's choices.
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


class _OldNames(torch.nn.Module):
    """A forward as transformers before 5.24 (and most remote code) declares it."""

    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return SimpleNamespace(past_key_values=("old", past_key_values))


class _NewNames(torch.nn.Module):
    """A forward as transformers 5.24 on declares it: the old keyword warns, and 5.40 drops it."""

    def forward(self, input_ids=None, cache=None, use_cache=None):
        return SimpleNamespace(cache=("new", cache), past_key_values=None)


@pytest.mark.parametrize(
    ("model", "keyword", "tag"), [(_OldNames(), "past_key_values", "old"), (_NewNames(), "cache", "new")]
)
def test_the_cache_goes_in_and_comes_back_under_the_name_the_forward_has(model, keyword, tag):
    assert common.cache_keyword(model) == keyword
    out = model(input_ids=None, use_cache=True, **{common.cache_keyword(model): "kv"})
    assert common.returned_cache(out) == (tag, "kv")
