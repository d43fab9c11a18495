"""Engine rows with prompt-tuning prefixes and LoRA adapters mixed in one batch, against transformers/peft."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedModel

from engines.base import EngineConfig, LoraAdapter, PrefillRow, PrefixEmbeddings
from engines.hf_transformers import HFTransformersEngine, load_padded
from engines.lora import LoraLoadError
from tests.engines.driver import NEW_TOKENS, Run, prompt_ids, reference_greedy, reference_model
from tests.integration import reference

PROMPTS = {
    "a": "Hello world",
    "b": "The quick brown fox 🦊 jumps over",
    "c": "naïve café — ünïcode 👍🏽 and more text to make this one longer",
    "d": "日本語のテキストと中文",
}
TOLERANCE = 1e-4


class AdapterRun(Run):
    """The test driver, with rows that carry a prefix or a LoRA adapter."""

    def join_rows(self, rows: Mapping[str, PrefillRow]) -> None:
        result = self.engine.prefill(list(rows.values()))
        self.names += list(rows)
        self._take(list(rows), result.next_token_logits)
        self.leave_finished()


def run_for(engine: HFTransformersEngine) -> AdapterRun:
    return AdapterRun(engine, frozenset(engine.spec.eos_token_ids))


def fresh_model(model_dir: Path) -> PreTrainedModel:
    """A model of its own: peft injects its layers into the model it wraps."""
    config = AutoConfig.from_pretrained(model_dir)
    model_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    return model_class.from_pretrained(model_dir, dtype=torch.float32).eval()


def ids_of(model_dir: Path) -> dict[str, tuple[int, ...]]:
    return {name: prompt_ids(model_dir, text) for name, text in PROMPTS.items()}


# ---- prompt-tuning prefixes -------------------------------------------------------------------------------


def random_prefix(model_dir: Path, rows: int, seed: int) -> torch.Tensor:
    """Virtual tokens on the scale of the model's own token embeddings."""
    weight = reference_model(model_dir).get_input_embeddings().weight.detach()
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, weight.shape[1], generator=generator) * float(weight.std())


def embed(model_dir: Path, ids: tuple[int, ...]) -> torch.Tensor:
    return reference_model(model_dir).get_input_embeddings()(torch.tensor(ids))


def reference_prefixed_greedy(
    model_dir: Path, prefix: torch.Tensor | None, ids: tuple[int, ...]
) -> list[int]:
    """transformers generate() on the prefix embeddings followed by the prompt's token embeddings."""
    if prefix is None:
        return list(reference_greedy(model_dir, ids))
    return reference.greedy_ids_with_prefix(reference_model(model_dir), ids, NEW_TOKENS, decoder=prefix)


def reference_t5_greedy(model_dir: Path, prefix: PrefixEmbeddings | None, ids: tuple[int, ...]) -> list[int]:
    """Encoder (prefix, tokens); decoder (prefix, start, generated tokens)."""
    decoder, encoder = (None, None) if prefix is None else (prefix.decoder, prefix.encoder)
    return reference.greedy_ids_with_prefix(
        reference_model(model_dir), ids, NEW_TOKENS, decoder=decoder, encoder=encoder
    )


def prefix_rows(decoder: torch.Tensor | None) -> PrefixEmbeddings | None:
    return None if decoder is None else PrefixEmbeddings(decoder=decoder)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bloom"])
def test_decoder_only_rows_with_different_prefixes_match_transformers(model_dirs, arch):
    model_dir = model_dirs(arch)
    engine = load_padded(EngineConfig(model_path=model_dir))
    ids = ids_of(model_dir)
    prefixes = {"a": random_prefix(model_dir, 4, 1), "b": None, "c": random_prefix(model_dir, 2, 2)}
    prefixes["d"] = random_prefix(model_dir, 6, 3)
    run = run_for(engine)
    run.join_rows({name: PrefillRow(ids[name], prefix=prefix_rows(prefixes[name])) for name in "abc"})
    run.step()
    run.step()
    run.join_rows({"d": PrefillRow(ids["d"], prefix=prefix_rows(prefixes["d"]))})  # joins mid-run
    run.finish()
    references = {name: reference_prefixed_greedy(model_dir, prefixes[name], ids[name]) for name in "abcd"}
    for name in "abcd":
        assert run.tokens[name] == references[name], name
    # The prefix steers generation, so a broken splice could not pass unnoticed.
    assert references["a"] != list(reference_greedy(model_dir, ids["a"]))
    assert engine.num_rows == 0 and engine.loras is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prompt_logits_with_a_prefix_cover_prefix_then_prompt_positions(model_dirs, arch):
    model_dir = model_dirs(arch)
    engine = load_padded(EngineConfig(model_path=model_dir))
    ids = ids_of(model_dir)
    prefix = random_prefix(model_dir, 3, 4)
    result = engine.prefill(
        [
            PrefillRow(ids["a"], want_prompt_logits=True, prefix=PrefixEmbeddings(decoder=prefix)),
            PrefillRow(ids["c"], want_prompt_logits=True),
            PrefillRow(ids["b"], prefix=PrefixEmbeddings(decoder=random_prefix(model_dir, 5, 5))),
        ]
    )
    with_prefix, without = result.prompt_logits[0], result.prompt_logits[1]
    assert with_prefix is not None and without is not None and result.prompt_logits[2] is None
    assert with_prefix.shape == (3 + len(ids["a"]), engine.spec.vocab_size)
    model = reference_model(model_dir)
    with torch.inference_mode():
        embeds = torch.cat([prefix, embed(model_dir, ids["a"])])[None]
        expected = model(inputs_embeds=embeds).logits[0].float()
        plain = model(input_ids=torch.tensor([ids["c"]])).logits[0].float()
    torch.testing.assert_close(with_prefix, expected, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(without, plain, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(result.next_token_logits[0], expected[-1], atol=TOLERANCE, rtol=0)


def test_t5_rows_with_encoder_decoder_or_both_prefixes_match_transformers(model_dirs):
    model_dir = model_dirs("t5")
    engine = load_padded(EngineConfig(model_path=model_dir))
    ids = ids_of(model_dir)
    prefixes: dict[str, PrefixEmbeddings | None] = {
        "a": PrefixEmbeddings(encoder=random_prefix(model_dir, 4, 11)),
        "b": PrefixEmbeddings(decoder=random_prefix(model_dir, 2, 12)),
        "c": PrefixEmbeddings(
            encoder=random_prefix(model_dir, 3, 13), decoder=random_prefix(model_dir, 5, 14)
        ),
        "d": None,
    }
    late = PrefixEmbeddings(decoder=random_prefix(model_dir, 3, 15))
    run = run_for(engine)
    run.join_rows({name: PrefillRow(ids[name], prefix=prefixes[name]) for name in "abcd"})
    run.step()
    # Its decoder cache is longer than the running rows' were: merging left-pads the shorter.
    run.join_rows({"late": PrefillRow(ids["d"], prefix=late)})
    run.step()
    run.leave(["b"])  # pruned early, unfinished
    run.finish()
    references = {name: reference_t5_greedy(model_dir, prefixes[name], ids[name]) for name in "abcd"}
    references["late"] = reference_t5_greedy(model_dir, late, ids["d"])
    assert run.tokens["b"] == references["b"][: len(run.tokens["b"])]
    for name in ("a", "c", "d", "late"):
        assert run.tokens[name] == references[name], name
    assert references["d"] == list(reference_greedy(model_dir, ids["d"]))
    for name in "abc":  # each prefix kind changes the answer
        assert references[name] != reference_t5_greedy(model_dir, None, ids[name]), name
    assert references["late"] != references["d"]


# ---- LoRA adapters -----------------------------------------------------------------------------------------

TARGETS = {
    "llama": (["q_proj", "v_proj"], ["o_proj", "down_proj", "gate_proj"]),
    "gpt2": (["c_attn"], ["c_proj", "c_fc"]),
    "t5": (["q", "v"], ["o", "wo"]),
}
A_ID, B_ID = "team/adapter.a", "b-2"


def make_lora(model_dir: Path, out: Path, targets: list[str], seed: int) -> Path:
    """A LoRA adapter with random (non-identity) weights, saved the way peft saves one."""
    base = fresh_model(model_dir)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(str(out))
    return out


def reference_lora_greedy(model_dir: Path, adapter_dir: Path, ids: tuple[int, ...]) -> list[int]:
    """peft's own generate() with the adapter loaded into a fresh base model."""
    return reference.greedy_ids(reference.lora_model(model_dir, adapter_dir), ids, NEW_TOKENS)


def lora_names(engine: HFTransformersEngine) -> set[str]:
    """The adapters present in the model's LoRA layers."""
    return {name for m in engine.model.modules() if isinstance(m, LoraLayer) for name in m.lora_A}


@pytest.fixture
def adapters(model_dirs, tmp_path) -> Callable[[str], tuple[Path, Path]]:
    def get(arch: str) -> tuple[Path, Path]:
        first, second = TARGETS[arch]
        model_dir = model_dirs(arch)
        return (
            make_lora(model_dir, tmp_path / f"{arch}-a", first, seed=21),
            make_lora(model_dir, tmp_path / f"{arch}-b", second, seed=22),
        )

    return get


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_lora_rows_mixed_in_one_batch_match_peft_generate(model_dirs, adapters, arch):
    model_dir = model_dirs(arch)
    dir_a, dir_b = adapters(arch)
    a, b = LoraAdapter(A_ID, dir_a), LoraAdapter(B_ID, dir_b)
    engine = load_padded(EngineConfig(model_path=model_dir))
    ids = ids_of(model_dir)
    run = run_for(engine)
    run.join_rows(
        {"a": PrefillRow(ids["a"], lora=a), "b": PrefillRow(ids["b"], lora=b), "base": PrefillRow(ids["c"])}
    )
    run.step()
    run.step()
    run.join_rows({"late_a": PrefillRow(ids["d"], lora=a), "late_base": PrefillRow(ids["a"])})
    run.step()
    run.leave(["b"])  # pruned early, unfinished
    run.finish()
    references = {
        "a": reference_lora_greedy(model_dir, dir_a, ids["a"]),
        "b": reference_lora_greedy(model_dir, dir_b, ids["b"]),
        "late_a": reference_lora_greedy(model_dir, dir_a, ids["d"]),
        "base": list(reference_greedy(model_dir, ids["c"])),
        "late_base": list(reference_greedy(model_dir, ids["a"])),
    }
    assert run.tokens["b"] == references["b"][: len(run.tokens["b"])]
    for name in ("a", "late_a", "base", "late_base"):
        assert run.tokens[name] == references[name], name
    # The adapters change the answers, so rows run without them could not pass.
    assert references["a"] != references["late_base"]
    assert references["b"] != list(reference_greedy(model_dir, ids["b"]))
    assert references["late_a"] != list(reference_greedy(model_dir, ids["d"]))
    assert engine.loras is not None and engine.loras.loaded == {A_ID, B_ID}


@pytest.mark.slow
def test_unload_lora_removes_the_adapter_now_or_once_its_rows_leave(model_dirs, adapters):
    model_dir = model_dirs("llama")
    dir_a, dir_b = adapters("llama")
    a, b = LoraAdapter(A_ID, dir_a), LoraAdapter(B_ID, dir_b)
    engine = load_padded(EngineConfig(model_path=model_dir))
    ids = ids_of(model_dir)
    run = run_for(engine)
    run.join_rows({"a": PrefillRow(ids["a"], lora=a), "b": PrefillRow(ids["b"], lora=b)})
    run.step()
    assert engine.loras is not None
    name_a, name_b = engine.loras.peft_name(A_ID), engine.loras.peft_name(B_ID)
    assert "." not in name_a and "/" not in name_a
    assert lora_names(engine) == {name_a, name_b}

    engine.unload_lora(A_ID)  # row "a" still runs with it: deferred
    assert engine.loras.loaded == {A_ID, B_ID}
    run.step()
    run.leave(["a"])  # its last row left: unloaded now
    assert engine.loras.loaded == {B_ID}
    assert lora_names(engine) == {name_b}
    run.finish()
    assert run.tokens["b"] == reference_lora_greedy(model_dir, dir_b, ids["b"])
    assert run.tokens["a"] == reference_lora_greedy(model_dir, dir_a, ids["a"])[: len(run.tokens["a"])]

    engine.unload_lora(B_ID)  # unused: unloaded at once; the last one unwraps the model
    engine.unload_lora("never-loaded")
    assert engine.loras.loaded == frozenset() and not engine.loras.wrapped
    assert not any(isinstance(module, LoraLayer) for module in engine.model.modules())

    run = run_for(engine)
    run.join_rows({"base": PrefillRow(ids["c"]), "again": PrefillRow(ids["d"], lora=a)})  # reloads A
    run.finish()
    assert run.tokens["base"] == list(reference_greedy(model_dir, ids["c"]))
    assert run.tokens["again"] == reference_lora_greedy(model_dir, dir_a, ids["d"])
    assert engine.loras.loaded == {A_ID}

    # A row that asks for an adapter again cancels its deferred unload.
    run = run_for(engine)
    run.join_rows({"x": PrefillRow(ids["a"], lora=a)})
    engine.unload_lora(A_ID)
    run.join_rows({"y": PrefillRow(ids["b"], lora=a)})
    run.finish()
    assert engine.loras.loaded == {A_ID}
    engine.clear()
    assert engine.loras.loaded == {A_ID}


def test_failed_lora_load_leaves_the_model_unwrapped(model_dirs, tmp_path):
    model_dir = model_dirs("gpt2")
    engine = load_padded(EngineConfig(model_path=model_dir))
    ids = ids_of(model_dir)
    broken = make_lora(model_dir, tmp_path / "broken", ["c_attn"], seed=31)
    for weights in broken.glob("adapter_model.*"):
        weights.unlink()
    with pytest.raises(LoraLoadError):
        engine.prefill([PrefillRow(ids["a"]), PrefillRow(ids["b"], lora=LoraAdapter("broken", broken))])
    assert engine.num_rows == 0
    assert engine.loras is not None and not engine.loras.wrapped
    assert not any(isinstance(module, LoraLayer) for module in engine.model.modules())

    prompt = tmp_path / "prompt"
    config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=2)
    get_peft_model(fresh_model(model_dir), config).save_pretrained(str(prompt))
    assert json.loads((prompt / "adapter_config.json").read_text())["peft_type"] == "PROMPT_TUNING"
    with pytest.raises(LoraLoadError, match="adapter type PROMPT_TUNING is not currently supported"):
        engine.prefill([PrefillRow(ids["a"], lora=LoraAdapter("prompt", prompt))])

    run = run_for(engine)
    run.join_rows({"a": PrefillRow(ids["a"])})
    run.finish()
    assert run.tokens["a"] == list(reference_greedy(model_dir, ids["a"]))


def test_lora_rows_are_refused_by_an_engine_without_lora(model_dirs, tmp_path):
    model_dir = model_dirs("gpt2")
    engine = load_padded(EngineConfig(model_path=model_dir))
    engine.spec = dataclasses.replace(engine.spec, supports_lora=False)
    adapter = LoraAdapter("x", make_lora(model_dir, tmp_path / "x", ["c_attn"], seed=41))
    with pytest.raises(ValueError, match="does not serve LoRA"):
        engine.prefill([PrefillRow(prompt_ids(model_dir, PROMPTS["a"]), lora=adapter)])
    assert engine.num_rows == 0 and engine.loras is None
