"""Tokenizer wrapper: specials, UTF-8 byte offsets, truncation with BOS, raw strings (SPEC §2.5, §2.7, §7)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from tests.fixtures.tiny import BOS, BOS_ID, EOS_ID, PAD_ID, UNK_ID
from tgis.tokenization.tokenizer import Encoding, Tokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE = "héllo wörld ☃ x"


@pytest.fixture(scope="module")
def gpt2(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    return Tokenizer(tokenizer)


@pytest.fixture(scope="module")
def llama(llama_tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    return Tokenizer(llama_tokenizer)


# ---------------------------------------------------------------- specials


def test_bos_detection(gpt2: Tokenizer, llama: Tokenizer) -> None:
    assert llama.adds_bos is True
    assert llama.bos_token_id == BOS_ID
    assert gpt2.adds_bos is False


def test_encode_adds_bos_only_for_bos_tokenizers(gpt2: Tokenizer, llama: Tokenizer) -> None:
    plain = gpt2.encode("Hello world").ids
    with_bos = llama.encode("Hello world").ids
    assert plain and plain[0] != BOS_ID
    assert with_bos == (BOS_ID, *plain)


def test_encode_returns_tuple_without_offsets_by_default(gpt2: Tokenizer) -> None:
    encoding = gpt2.encode("Hello world")
    assert isinstance(encoding, Encoding)
    assert isinstance(encoding.ids, tuple)
    assert encoding.byte_offsets == ()


def test_empty_text_encodes_to_nothing_or_just_bos(gpt2: Tokenizer, llama: Tokenizer) -> None:
    assert gpt2.encode("").ids == ()
    assert llama.encode("").ids == (BOS_ID,)


def test_special_ids_include_the_tokenizer_specials(gpt2: Tokenizer) -> None:
    assert {PAD_ID, EOS_ID, BOS_ID, UNK_ID} <= gpt2.special_ids


# ---------------------------------------------------------------- byte offsets (§2.7)


def test_ascii_byte_offsets_equal_character_offsets(gpt2: Tokenizer) -> None:
    text = "Hello world, this is a test."
    encoding = gpt2.encode(text, with_offsets=True)
    chars = gpt2.hf(text, return_offsets_mapping=True)["offset_mapping"]
    assert list(encoding.byte_offsets) == [tuple(pair) for pair in chars]
    assert len(encoding.byte_offsets) == len(encoding.ids)
    assert encoding.byte_offsets[-1][1] == len(text)


def test_offsets_are_utf8_bytes_not_characters(gpt2: Tokenizer) -> None:
    text = "☃ x"  # the snowman is 1 character but 3 UTF-8 bytes
    encoding = gpt2.encode(text, with_offsets=True)
    assert gpt2.token_strings(encoding.ids)[-1] == "Ġx"
    assert encoding.byte_offsets[-1] == (3, 5)  # character offsets would be (1, 3)


def test_byte_offsets_slice_each_whole_token_out_of_the_utf8_text(gpt2: Tokenizer) -> None:
    data = MULTIBYTE.encode("utf-8")
    encoding = gpt2.encode(MULTIBYTE, with_offsets=True)
    assert len(encoding.byte_offsets) == len(encoding.ids)
    checked = 0
    for token_id, (start, end) in zip(encoding.ids, encoding.byte_offsets, strict=True):
        assert 0 <= start <= end <= len(data)
        piece = str(gpt2.hf.decode([token_id]))
        if REPLACEMENT not in piece:  # tokens holding part of a character map to the whole character
            assert data[start:end] == piece.encode("utf-8")
            checked += 1
    assert checked >= 3
    assert encoding.byte_offsets[-1][1] == len(data)


def test_byte_offsets_are_monotonic(gpt2: Tokenizer) -> None:
    offsets = gpt2.encode(MULTIBYTE, with_offsets=True).byte_offsets
    starts = [start for start, _ in offsets]
    ends = [end for _, end in offsets]
    assert starts == sorted(starts)
    assert ends == sorted(ends)


def test_special_tokens_have_zero_offsets(gpt2: Tokenizer, llama: Tokenizer) -> None:
    with_bos = llama.encode(MULTIBYTE, with_offsets=True)
    plain = gpt2.encode(MULTIBYTE, with_offsets=True)
    assert with_bos.ids[0] == BOS_ID
    assert with_bos.byte_offsets[0] == (0, 0)
    assert with_bos.byte_offsets[1:] == plain.byte_offsets


def test_empty_text_offsets(gpt2: Tokenizer, llama: Tokenizer) -> None:
    assert gpt2.encode("", with_offsets=True) == Encoding((), ())
    assert llama.encode("", with_offsets=True) == Encoding((BOS_ID,), ((0, 0),))


# ---------------------------------------------------------------- truncation (§7)


def test_truncate_keeps_the_last_ids(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("one two three four five six").ids
    assert len(ids) > 3
    assert gpt2.truncate(ids, 3) == tuple(ids[-3:])


@pytest.mark.parametrize("keep", [0, -1])
def test_truncate_zero_means_no_truncation(gpt2: Tokenizer, llama: Tokenizer, keep: int) -> None:
    ids = llama.encode("one two three").ids
    assert gpt2.truncate(ids, keep) == ids
    assert llama.truncate(ids, keep) == ids


def test_truncate_at_or_above_length_changes_nothing(llama: Tokenizer) -> None:
    ids = llama.encode("one two three").ids
    assert llama.truncate(ids, len(ids)) == ids
    assert llama.truncate(ids, len(ids) + 10) == ids
    assert llama.truncate(list(ids), len(ids)) == ids


def test_truncate_overwrites_first_kept_id_with_bos(llama: Tokenizer) -> None:
    ids = llama.encode("one two three four five six").ids
    assert ids[0] == BOS_ID and len(ids) > 4
    truncated = llama.truncate(ids, 4)
    assert len(truncated) == 4
    assert truncated == (BOS_ID, *ids[-3:])


def test_truncate_to_one_leaves_only_bos(llama: Tokenizer) -> None:
    ids = llama.encode("one two three").ids
    assert llama.truncate(ids, 1) == (BOS_ID,)


def test_truncate_without_bos_keeps_the_real_ids(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("one two three").ids
    assert gpt2.truncate(ids, 1) == (ids[-1],)
    assert BOS_ID not in gpt2.truncate(ids, 2)


# ---------------------------------------------------------------- raw token strings (§2.5)


def test_token_strings_are_raw_vocabulary_strings(gpt2: Tokenizer) -> None:
    ids = gpt2.encode("Hello world").ids
    strings = gpt2.token_strings(ids)
    assert strings == gpt2.hf.convert_ids_to_tokens(list(ids))
    assert any(string.startswith("Ġ") for string in strings)  # byte-level space marker, not " "
    assert "".join(strings).replace("Ġ", " ") == "Hello world"


def test_token_strings_of_specials(llama: Tokenizer) -> None:
    assert llama.token_strings([BOS_ID, EOS_ID, PAD_ID, UNK_ID]) == [BOS, "</s>", "<pad>", "<unk>"]


def test_unknown_ids_give_empty_strings(gpt2: Tokenizer) -> None:
    vocab = len(gpt2.hf)
    ids = gpt2.encode("Hi").ids
    assert gpt2.token_strings([vocab, vocab + 5, 10**6, -1]) == ["", "", "", ""]
    known = gpt2.token_strings([ids[0]])[0]
    assert known != ""
    assert gpt2.token_strings([ids[0], vocab, ids[0]]) == [known, "", known]


def test_last_vocabulary_id_is_known(gpt2: Tokenizer) -> None:
    assert gpt2.token_strings([len(gpt2.hf) - 1])[0] != ""


# ---------------------------------------------------------------- decode and load


def test_decode_round_trips_and_skips_specials_by_default(llama: Tokenizer) -> None:
    text = "Hello world, once more"
    assert llama.decode(llama.encode(text).ids) == text


def test_load_from_directory_with_special_token_output(
    tmp_path: Path, llama_tokenizer: PreTrainedTokenizerBase
) -> None:
    llama_tokenizer.save_pretrained(tmp_path)
    quiet = Tokenizer.load(tmp_path)
    loud = Tokenizer.load(tmp_path, output_special_tokens=True)
    ids = quiet.encode("Hello").ids
    assert quiet.adds_bos and ids[0] == BOS_ID
    assert quiet.decode(ids) == "Hello"
    assert loud.decode(ids) == f"{BOS}Hello"
