"""Property tests over random token sequences of every fixture tokenizer (gpt2, llama and t5 styles).

The incremental detokenizer: released text concatenates to the full decode (trailing U+FFFD aside)
and no broken character is ever released mid-stream (everything released stays a prefix of the
final text). The stop matcher, driven by that detokenizer as the server drives it: its deltas never
retract and the final text, reason, count and reported sequence equal a brute-force reading of SPEC
§5.3/§5.6 (`oracle.apply_stop_rules`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tests.conformance.oracle import REPLACEMENT, apply_stop_rules
from tests.fixtures.tiny import EOS_ID, TokenizerStyle, build_tokenizer
from tgis.stopping import OutputTracker, StopCriteria
from tgis.tokenization.detokenizer import for_tokenizer, tokenizer_decoder
from tgis.types import StopReason

STYLES: tuple[TokenizerStyle, ...] = ("gpt2", "llama", "t5")
CONTEXT = 5  # prompt ids the server's detokenizer keeps for decoder-only continuation


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {
        style: AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp(f"tok-{style}"), style))
        for style in STYLES
    }


def continuation_decoder(tokenizer: Any, prompt_ids: Sequence[int], decoder_only: bool) -> Any:
    """decode(generated) as the server shows it: the text the ids add after the prompt's last ids."""
    decode = tokenizer_decoder(tokenizer, skip_special_tokens=True)
    context = list(prompt_ids[-CONTEXT:]) if decoder_only else []
    base = decode(context)

    def continued(ids: Sequence[int]) -> str:
        return decode([*context, *ids])[len(base) :]

    return continued


token_lists = st.lists(st.integers(0, 10_000), max_size=20)


@pytest.mark.parametrize("style", STYLES)
@settings(max_examples=60, deadline=None)
@given(raw_ids=token_lists, prompt=st.text(max_size=10), decoder_only=st.booleans())
def test_detokenizer_releases_the_full_decode_without_broken_characters(
    tokenizers: dict[str, Any], style: str, raw_ids: list[int], prompt: str, decoder_only: bool
) -> None:
    tokenizer = tokenizers[style]
    ids = [i % len(tokenizer) for i in raw_ids]
    prompt_ids = tokenizer(prompt)["input_ids"]
    detokenizer = for_tokenizer(tokenizer, prompt_ids, decoder_only=decoder_only, skip_special_tokens=True)
    full = continuation_decoder(tokenizer, prompt_ids, decoder_only)(ids)
    released = ""
    for token in ids:
        released += detokenizer.add(token)
        assert full.startswith(released), "released text later changed: a broken character got out"
    released += detokenizer.flush()
    assert released == full.rstrip(REPLACEMENT)


@st.composite
def repetitive_ids(draw: st.DrawFn, vocab_size: int) -> list[int]:
    """Random ids, or ids from a pool of a few, whose repeated text gives overlapping stop matches."""
    pool = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=3))
    ids = draw(st.one_of(token_lists, st.lists(st.sampled_from(pool), max_size=20)))
    return [i % vocab_size for i in ids]


@st.composite
def stop_scenarios(draw: st.DrawFn, tokenizer: Any) -> dict[str, Any]:
    ids = draw(repetitive_ids(len(tokenizer)))
    prompt_ids = tokenizer(draw(st.text(max_size=8)))["input_ids"]
    decoder_only = draw(st.booleans())
    text = continuation_decoder(tokenizer, prompt_ids, decoder_only)(ids).replace(REPLACEMENT, "")
    # Stop sequences cut from the output itself, so that they match; plus the odd one that may not.
    pieces = st.tuples(st.integers(0, len(text)), st.integers(1, 4)).map(lambda p: text[p[0] : p[0] + p[1]])
    # A character seen twice can match twice within one token's text: the rightmost-match rule.
    repeated = sorted({ch for ch in text if text.count(ch) > 1}) or ["a"]
    stop = st.one_of(pieces, st.sampled_from(repeated), st.text(min_size=1, max_size=3))
    stops = draw(st.lists(stop, max_size=4))
    return {
        "ids": ids,
        "prompt_ids": prompt_ids,
        "decoder_only": decoder_only,
        "stops": [s for s in stops if s],
        "include": draw(st.booleans()),
        "min_new": draw(st.integers(0, 4)),
        "max_new": draw(st.integers(1, 24)),
    }


@pytest.mark.parametrize("style", STYLES)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_stop_matching_over_real_tokens_equals_brute_force(
    tokenizers: dict[str, Any], style: str, data: st.DataObject
) -> None:
    tokenizer = tokenizers[style]
    case = data.draw(stop_scenarios(tokenizer))
    criteria = StopCriteria(
        max_new_tokens=case["max_new"],
        min_new_tokens=case["min_new"],
        stop_sequences=tuple(case["stops"]),
        include_stop_sequence=case["include"],
        eos_token_ids=frozenset({EOS_ID}),
    )
    source = for_tokenizer(
        tokenizer, case["prompt_ids"], decoder_only=case["decoder_only"], skip_special_tokens=True
    )
    tracker = OutputTracker(criteria, source)
    released = ""
    outcome = None
    for token in case["ids"]:
        outcome = tracker.on_token(token)
        released += outcome.text
        if outcome.finished:
            break
    expected = apply_stop_rules(
        continuation_decoder(tokenizer, case["prompt_ids"], case["decoder_only"]),
        EOS_ID,
        case["ids"],
        max_new_tokens=case["max_new"],
        min_new_tokens=case["min_new"],
        stop_sequences=case["stops"],
        include_stop_sequence=case["include"],
    )
    if expected is None:  # the tokens ran out first: the request is still going
        assert outcome is None or not outcome.finished
        assert expected_prefix_holds(released, tokenizer, case)
        return
    assert outcome is not None and outcome.finished
    assert released == tracker.released_text == expected.text
    assert (outcome.stop_reason, outcome.generated_token_count) == (
        StopReason[expected.stop_reason],
        expected.count,
    )
    assert (outcome.stop_sequence or "") == expected.stop_sequence


def expected_prefix_holds(released: str, tokenizer: Any, case: dict[str, Any]) -> bool:
    """Unfinished: what was released is a prefix of everything decoded so far."""
    full = continuation_decoder(tokenizer, case["prompt_ids"], case["decoder_only"])(case["ids"])
    return full.startswith(released)


def test_fixture_tokenizers_are_the_three_styles(tokenizers: dict[str, Any]) -> None:
    """The properties above run over a BOS tokenizer, a plain one and one appending </s>."""
    assert tokenizers["llama"]("a")["input_ids"][0] == tokenizers["llama"].bos_token_id
    assert tokenizers["t5"]("a")["input_ids"][-1] == tokenizers["t5"].eos_token_id
    assert len(tokenizers["gpt2"]("")["input_ids"]) == 0
