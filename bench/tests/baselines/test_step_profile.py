"""The step profile: operators put in buckets by name and enclosing labels, and a real profiled step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from engines.base import EngineSpec
from engines.paged.engine import build
from tests.fixtures.tiny import make_model
from tgis_bench.baselines.step_profile import (
    ATTENTION,
    BUCKETS,
    LM_HEAD,
    MODEL,
    STEP,
    StepProfile,
    bucket_of,
    bucket_times,
    build_thin_twin,
    floor_lines,
    profile_decode_step,
)


@dataclass
class Event:
    """The three fields of a torch profiler FunctionEvent that bucketing reads."""

    name: str
    self_cpu_time_total: float  # µs
    cpu_parent: Event | None = None


def test_operators_are_bucketed_by_the_labels_around_them_then_by_name():
    assert bucket_of("mkldnn::_linear_pointwise", (MODEL, STEP)) == "linear layers (matmuls)"
    assert bucket_of("tgis::few_rows_linear", (MODEL, STEP)) == "linear layers (matmuls)"
    assert bucket_of("aten::mm", (LM_HEAD, MODEL, STEP)) == "LM head"
    assert bucket_of("aten::index_copy_", (ATTENTION, MODEL, STEP)) == "attention (KV write and kernel)"
    assert bucket_of("aten::native_layer_norm", (MODEL, STEP)) == "norms"
    assert bucket_of("aten::gelu", (MODEL,)) == "activations"
    assert bucket_of("aten::add", (MODEL,)) == "other math (residual adds, embeddings...)"
    assert bucket_of("aten::view", (MODEL,)) == "tensor bookkeeping (views, allocations, copies)"
    assert bucket_of(MODEL, (STEP,)) == "Python in transformers' modules"
    assert bucket_of("aten::arange", (STEP,)) == "step inputs and outputs (tgis)"  # outside the model
    assert bucket_of(STEP, ()) == "step inputs and outputs (tgis)"


def test_bucket_times_add_each_events_own_time_once():
    step = Event(STEP, 100.0)
    model = Event(MODEL, 2000.0, step)
    attention = Event(ATTENTION, 300.0, model)
    events = [
        step,
        model,
        attention,
        Event("aten::index_copy_", 50.0, attention),
        Event("aten::addmm", 4000.0, model),
    ]
    totals = bucket_times(events)
    assert set(totals) == set(BUCKETS)
    assert totals["attention (KV write and kernel)"] == pytest.approx(0.35)
    assert totals["linear layers (matmuls)"] == pytest.approx(4.0)
    assert totals["Python in transformers' modules"] == pytest.approx(2.0)
    assert totals["step inputs and outputs (tgis)"] == pytest.approx(0.1)
    assert sum(totals.values()) == pytest.approx(6.45)


def test_a_profiled_step_finds_the_models_matmuls_attention_and_head():
    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    engine = build(model, spec)
    engine.allocate(8, 16)
    profile = profile_decode_step(engine, "float32", prompt_tokens=12, steps=3)
    for bucket in ("linear layers (matmuls)", "LM head", "attention (KV write and kernel)"):
        assert profile.profiled_ms[bucket] > 0, bucket
    assert profile.step_ms_p50 >= profile.step_ms_min > 0 and profile.operators_per_step > 10
    table = "\n".join(profile.lines())
    assert "| LM head |" in table and "after a 12-token prompt, 3 steps" in table
    with pytest.raises(ValueError, match="pool holds 8 blocks"):
        profile_decode_step(engine, "float32", prompt_tokens=200, steps=3)
    limited = build(make_model("llama").eval(), dataclasses.replace(spec, model_config={"n_positions": 20}))
    limited.allocate(8, 16)
    with pytest.raises(ValueError, match="take 23 positions; the model has 20"):
        profile_decode_step(limited, "float32", prompt_tokens=12, steps=3)


def test_the_costs_around_the_step_are_timed_with_the_servers_own_parts(tmp_path):
    from transformers import AutoTokenizer

    from tests.fixtures.tiny import VOCAB_SIZE, build_tokenizer
    from tgis_bench.baselines.token_costs import measure_token_costs

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok", "gpt2"))
    costs = measure_token_costs(tokenizer, VOCAB_SIZE, [int(tokenizer.eos_token_id)], rounds=8)
    parts = (costs.sampling_us, costs.output_us, costs.handoff_us, costs.message_us)
    assert all(us > 0 for us in parts), parts
    table = "\n".join(costs.lines())
    assert "median of 8" in table and "| hand-off to the event loop" in table
    assert table.count("\n| ") == 5  # the heading row and the four parts


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox"])
def test_the_thin_twin_keeps_the_architecture_at_a_width_of_almost_nothing(tmp_path, arch):
    """Same family, layers and vocabulary; one head (one kv head) of the new width and an MLP four
    times as wide; it loads as the server loads a model, on the paged step, and speaks the same tokens."""
    import os

    from transformers import AutoConfig, AutoTokenizer

    from engines.paged.engine import PagedHFEngine
    from tests.fixtures.tiny import build_model
    from tgis.config import Settings
    from tgis.startup.model import load_model

    model_dir = build_model(tmp_path / "model", arch)
    twin = build_thin_twin(model_dir, tmp_path / "twin", width=8)
    original, thin = AutoConfig.from_pretrained(model_dir), AutoConfig.from_pretrained(twin)
    assert (thin.model_type, thin.num_hidden_layers, thin.vocab_size) == (
        original.model_type,
        original.num_hidden_layers,
        original.vocab_size,
    )
    assert (thin.hidden_size, thin.num_attention_heads) == (8, 1)
    assert getattr(thin, "num_key_value_heads", 1) == 1
    assert getattr(thin, "intermediate_size", None) in (None, 32) and getattr(thin, "n_inner", None) in (
        None,
        32,
    )
    text = "hello world"
    assert (
        AutoTokenizer.from_pretrained(twin)(text).input_ids
        == AutoTokenizer.from_pretrained(model_dir)(text).input_ids
    )
    engine = load_model(Settings(model_name=str(twin)), {**os.environ, "MODEL_NAME": str(twin)}).engine
    assert isinstance(engine, PagedHFEngine)
    engine.allocate(8, 16)
    profile = profile_decode_step(engine, "float32", prompt_tokens=12, steps=2)
    assert profile.step_ms_p50 > 0


def test_the_floor_is_set_against_the_models_step():
    def profile(step_ms: float, linear_ms: float, python_ms: float) -> StepProfile:
        buckets = {"linear layers (matmuls)": linear_ms, "Python in transformers' modules": python_ms}
        return StepProfile("float32", 64, 8, step_ms, step_ms, buckets, 1000)

    [line] = floor_lines(profile(20.0, 15.0, 3.0), profile(5.0, 1.5, 2.5))
    assert "**5.00 ms** p50 a step, 25% of the step above" in line
    assert "1.50 ms of it in linear layers, 2.50 ms Python" in line


def test_the_command_profiles_a_quantized_model_as_the_server_loads_it(model_dirs, tmp_path):
    from tgis_bench.baselines.step_profile import main

    out = tmp_path / "profile.md"
    args = ["--model-dir", str(model_dirs("gpt2")), "--dtype", "float32", "--quantize", "int8"]
    assert main([*args, "--prompt-tokens", "8", "--steps", "3", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Decode step at batch 1, float32, QUANTIZE=int8, after a 8-token prompt" in text
