"""The tiny test assets themselves: they build fast and deterministically and behave usefully."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from tests.fixtures import tiny
from tests.integration import reference

PROMPTS = [
    "Hello world",
    "The quick brown fox 🦊 jumps over",
    "日本語のテキストと中文",
    "naïve café — ünïcode 👍🏽 and more text",
    "def greet(name: str) -> str:",
]
NEW_TOKENS = 24
STYLES: tuple[tiny.TokenizerStyle, ...] = ("gpt2", "llama", "t5")
StyleDirs = dict[str, Path]


# Any: transformers types `generate` on the concrete model classes only, not PreTrainedModel.
def load_model(model_dir: Path, arch: str) -> Any:
    auto_class = AutoModelForSeq2SeqLM if arch == "t5" else AutoModelForCausalLM
    return auto_class.from_pretrained(model_dir).eval()


def greedy(model: Any, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    return reference.greedy_ids(model, ids, new_tokens)


@pytest.fixture(scope="module")
def style_dirs(tmp_path_factory: pytest.TempPathFactory) -> StyleDirs:
    return {s: tiny.build_tokenizer(tmp_path_factory.mktemp(f"style-{s}"), s) for s in STYLES}


# --- tokenizers ---------------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_special_token_ids_are_fixed_and_recorded(style_dirs: StyleDirs, style: tiny.TokenizerStyle) -> None:
    tok = AutoTokenizer.from_pretrained(style_dirs[style])
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token) == ("<pad>", "</s>", "<s>", "<unk>")
    assert 512 <= len(tok) <= 1000


def test_gpt2_style_adds_no_special_tokens(tokenizer) -> None:
    assert tokenizer("hi")["input_ids"] == tokenizer("hi", add_special_tokens=False)["input_ids"]


def test_llama_style_prepends_bos(llama_tokenizer) -> None:
    ids = llama_tokenizer("hi")["input_ids"]
    assert ids[0] == llama_tokenizer.bos_token_id
    assert ids[1:] == llama_tokenizer("hi", add_special_tokens=False)["input_ids"]
    assert llama_tokenizer.eos_token_id not in ids


def test_t5_style_appends_eos(style_dirs: StyleDirs) -> None:
    tok = AutoTokenizer.from_pretrained(style_dirs["t5"])
    ids = tok("hi")["input_ids"]
    assert ids[-1] == tok.eos_token_id
    assert ids[:-1] == tok("hi", add_special_tokens=False)["input_ids"]
    assert tok.bos_token_id not in ids


@pytest.mark.parametrize("style", STYLES)
def test_corpus_round_trips_exactly(style_dirs: StyleDirs, style: tiny.TokenizerStyle) -> None:
    tok = AutoTokenizer.from_pretrained(style_dirs[style])
    extra = ["  leading and trailing spaces  ", "\ttab\nnewline", "unseen: 🦀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ"]
    for line in [*tiny.corpus_lines(), *extra]:
        ids = tok(line)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == line


@pytest.mark.parametrize("style", STYLES)
def test_reloaded_tokenizer_encodes_like_trained(style_dirs: StyleDirs, style: tiny.TokenizerStyle) -> None:
    trained = tiny.train_tokenizer(style)
    reloaded = AutoTokenizer.from_pretrained(style_dirs[style])
    for line in tiny.corpus_lines():
        assert reloaded(line)["input_ids"] == trained.encode(line).ids


def test_multibyte_characters_are_often_split_into_partial_utf8_tokens(tokenizer) -> None:
    # A token whose bytes are not whole UTF-8 characters decodes to U+FFFD on its own.
    for text in ["我爱北京天安门", "👨‍👩‍👧", "🦀", "ひらがな、カタカナ"]:
        pieces = [tokenizer.decode([i]) for i in tokenizer(text)["input_ids"]]
        assert any("\ufffd" in piece for piece in pieces), (text, pieces)


def test_some_multibyte_characters_are_whole_tokens(tokenizer) -> None:
    # The corpus repeats é, ñ and others often enough to earn merges: both cases exist.
    whole = [c for c in "éñüøç東京" if len(tokenizer(c)["input_ids"]) == 1]
    assert whole


def test_tokenizer_build_is_deterministic(tmp_path: Path) -> None:
    first = tiny.build_tokenizer(tmp_path / "a", "llama")
    second = tiny.build_tokenizer(tmp_path / "b", "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


# --- models -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_model_config_matches_its_tokenizer(model_dirs: Callable[[str], Path], arch: str) -> None:
    model_dir = model_dirs(arch)
    model = load_model(model_dir, arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    assert config.vocab_size == len(tok)
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (
        tok.eos_token_id,
        tok.bos_token_id,
        tok.pad_token_id,
    )
    assert model.dtype == torch.float32
    assert (model_dir / "model.safetensors").exists()
    if arch == "t5":
        assert config.decoder_start_token_id == tok.pad_token_id
    if arch == "llama":
        assert config.num_key_value_heads < config.num_attention_heads


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_reloaded_model_equals_the_built_one(model_dirs: Callable[[str], Path], arch: str) -> None:
    reloaded = load_model(model_dirs(arch), arch).state_dict()
    built = tiny.make_model(arch).state_dict()  # type: ignore[arg-type]
    assert reloaded.keys() == built.keys()
    for name, tensor in built.items():
        assert torch.equal(reloaded[name], tensor), name


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_greedy_generation_is_varied_and_rarely_ends(model_dirs: Callable[[str], Path], arch: str) -> None:
    model_dir = model_dirs(arch)
    model = load_model(model_dir, arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    outputs = [greedy(model, tok(p)["input_ids"]) for p in PROMPTS]
    full_length = [out for out in outputs if len(out) == NEW_TOKENS]
    assert len(full_length) >= len(PROMPTS) - 1, outputs  # EOS comes, but not constantly
    for out in full_length:
        assert len(set(out)) >= 6, out  # no single-token loops or 2-3 token cycles
    assert len({tuple(out) for out in outputs}) == len(outputs)  # the prompt matters
    generated = {t for out in outputs for t in out}
    assert not generated & {tok.pad_token_id, tok.bos_token_id, tok.unk_token_id}


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_batched_greedy_equals_solo_with_margins_far_above_noise(
    model_dirs: Callable[[str], Path], arch: str
) -> None:
    model_dir = model_dirs(arch)
    model = load_model(model_dir, arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    # Decoder-only batches pad on the left so every row's next token sits in the last column.
    tok.padding_side = "right" if arch == "t5" else "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    batched = generate_with_logits(model, batch["input_ids"], batch["attention_mask"])
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        solo = generate_with_logits(model, ids, torch.ones_like(ids))
        for step, logits in enumerate(solo):
            noise = (batched[step][row] - logits[0]).abs().max().item()
            top2 = logits[0].topk(2).values
            assert noise < 1e-4, (prompt, step)
            assert (top2[0] - top2[1]).item() > 5 * noise, (prompt, step)


def generate_with_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return list(out.logits)


def test_building_every_arch_takes_seconds(tmp_path: Path) -> None:
    tiny.make_model("gpt2")  # pays the one-off import of the modeling code outside the timing
    start = time.perf_counter()
    for arch in tiny.ARCHS:
        tiny.build_model(tmp_path / arch, arch)
    assert time.perf_counter() - start < 15.0


def test_model_build_is_deterministic(tmp_path: Path) -> None:
    for arch in ("llama", "t5"):
        first = tiny.build_model(tmp_path / f"{arch}-a", arch)
        second = tiny.build_model(tmp_path / f"{arch}-b", arch)
        assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_make_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    tiny.make_model("gpt2")
    assert torch.equal(torch.rand(3), expected)
