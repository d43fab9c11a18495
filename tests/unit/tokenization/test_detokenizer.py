"""Incremental detokenization: continuation, broken characters, special tokens, parity (SPEC §5.1–§5.2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tgis.tokenization.detokenizer import IncrementalDetokenizer, for_tokenizer

REPLACEMENT = "\ufffd"


def bytes_decoder(vocab: Mapping[int, bytes]) -> IncrementalDetokenizer:
    """A detokenizer over a fake byte vocabulary, decoded like a byte-level BPE (lossy UTF-8)."""
    return IncrementalDetokenizer(lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", "replace"))


def single_bytes() -> dict[int, bytes]:
    return {b: bytes([b]) for b in range(256)}


@cache
def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, to look up single-byte tokens."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    for offset, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + offset)
    return table


def byte_ids(tokenizer: Any, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `text`."""
    return [tokenizer.convert_tokens_to_ids(byte_level_chars()[b]) for b in text.encode()]


def released(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    return [detok.add(i) for i in ids]


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-like word-boundary tokenizer whose decode drops the first token's leading space."""
    vocab = {"<unk>": 0, "▁Once": 1, "▁upon": 2, "▁a": 3, "▁time": 4, "</s>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


# --- continuation (§5.1.1) ---


def test_decoder_only_first_token_keeps_leading_space(metaspace_tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = metaspace_tokenizer.encode("Once upon a")
    detok = for_tokenizer(metaspace_tokenizer, prompt, decoder_only=True, skip_special_tokens=True)
    assert released(detok, [4, 2]) == [" time", " upon"]


def test_encoder_decoder_output_starts_fresh(metaspace_tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = metaspace_tokenizer.encode("Once upon a")
    detok = for_tokenizer(metaspace_tokenizer, prompt, decoder_only=False, skip_special_tokens=True)
    assert released(detok, [4, 2]) == ["time", " upon"]


def test_context_is_limited_to_last_prompt_ids(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Once upon a time, in a quiet village")
    detok = for_tokenizer(tokenizer, prompt, decoder_only=True, skip_special_tokens=True, context_size=3)
    assert detok.ids == prompt[-3:]


def test_byte_level_continuation_matches_decoding_prompt_and_output(tokenizer: Any) -> None:
    prompt = tokenizer.encode("The weather was")
    generated = tokenizer.encode(" cold, the wind was strong")
    detok = for_tokenizer(tokenizer, prompt, decoder_only=True, skip_special_tokens=True)
    assert "".join(released(detok, generated)) + detok.flush() == " cold, the wind was strong"


# --- broken characters (§5.1.2) ---


def test_multibyte_character_split_over_tokens_is_held_until_complete(tokenizer: Any) -> None:
    detok = for_tokenizer(tokenizer, tokenizer.encode("ok"), decoder_only=True, skip_special_tokens=True)
    assert released(detok, byte_ids(tokenizer, "👍é")) == ["", "", "", "👍", "", "é"]
    assert not detok.has_pending


def test_flush_trims_incomplete_character(tokenizer: Any) -> None:
    detok = for_tokenizer(tokenizer, [], decoder_only=False, skip_special_tokens=True)
    assert released(detok, byte_ids(tokenizer, "a") + byte_ids(tokenizer, "👍")[:3]) == ["a", "", "", ""]
    assert detok.has_pending
    assert detok.flush() == ""


def test_flush_releases_text_before_incomplete_tail() -> None:
    detok = bytes_decoder({1: b"x", 2: b"A" + "é".encode()[:1]})
    assert released(detok, [1, 2]) == ["x", ""]
    assert detok.flush() == "A"


def test_invalid_byte_then_text_is_released_with_replacement_char() -> None:
    detok = bytes_decoder(single_bytes())
    assert released(detok, [0x80, ord("A")]) == ["", "\ufffdA"]


def test_literal_replacement_char_released_once_more_text_arrives() -> None:
    detok = bytes_decoder(single_bytes())
    assert released(detok, [*REPLACEMENT.encode(), ord("!")]) == ["", "", "", "\ufffd!"]


# --- special tokens (§5.1.4) ---


def test_skipped_special_token_renders_nothing(tokenizer: Any) -> None:
    detok = for_tokenizer(tokenizer, tokenizer.encode("Hi"), decoder_only=True, skip_special_tokens=True)
    text = released(detok, [tokenizer.eos_token_id, *tokenizer.encode(" there")])
    assert text[0] == ""
    assert "".join(text) == " there"


def test_special_token_rendered_when_not_skipped(llama_tokenizer: Any) -> None:
    prompt = llama_tokenizer.encode("Hi")  # starts with BOS, which the context then renders too
    detok = for_tokenizer(llama_tokenizer, prompt, decoder_only=True, skip_special_tokens=False)
    generated = [llama_tokenizer.eos_token_id, *llama_tokenizer.encode(" there", add_special_tokens=False)]
    assert "".join(released(detok, generated)) == "</s> there"


# --- properties (§5.1.2, §5.1.5) ---


def assert_unbroken(chunks: Sequence[str], expected: str) -> None:
    assert all(not chunk.endswith(REPLACEMENT) for chunk in chunks)
    assert "".join(chunks) == expected


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip_special=st.booleans())
def test_released_text_equals_full_decode(tokenizer: Any, data: st.DataObject, skip_special: bool) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=24))
    detok = for_tokenizer(tokenizer, [], decoder_only=False, skip_special_tokens=skip_special)
    chunks = [*released(detok, ids), detok.flush()]
    full = tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)
    assert_unbroken(chunks, full.rstrip(REPLACEMENT))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), prompt=st.text(min_size=1, max_size=12))
def test_released_text_continues_prompt(tokenizer: Any, data: st.DataObject, prompt: str) -> None:
    prompt_ids = tokenizer.encode(prompt)
    ids = data.draw(st.lists(st.integers(4, len(tokenizer) - 1), max_size=16))
    detok = for_tokenizer(tokenizer, prompt_ids, decoder_only=True, skip_special_tokens=True)
    chunks = [*released(detok, ids), detok.flush()]
    context = prompt_ids[-5:]
    decode = detok.decode
    assert_unbroken(chunks, decode(context + ids)[len(decode(context)) :].rstrip(REPLACEMENT))


utf8_pieces = st.lists(
    st.one_of(st.text(max_size=3).map(str.encode), st.binary(min_size=1, max_size=2)), max_size=10
)


@settings(max_examples=300, deadline=None)
@given(pieces=utf8_pieces, data=st.data())
def test_released_bytes_equal_lossy_decode_of_all_bytes(pieces: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=len(stream))))
    tokens = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True) if a < b]
    detok = bytes_decoder(dict(enumerate(tokens)))
    chunks = [*released(detok, range(len(tokens))), detok.flush()]
    assert_unbroken(chunks, stream.decode("utf-8", "replace").rstrip(REPLACEMENT))
