"""Stop-reason precedence, stop-sequence matching and streaming release (SPEC §5.3–§5.6)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from tgis.stopping import OutputTracker, StopCriteria
from tgis.tokenization.detokenizer import for_tokenizer
from tgis.types import StoppingParams, StopReason, TokenEvent

EOS = 10_000


@dataclass
class ChunkSource:
    """Fake detokenizer: token i renders texts[i]; `pending` is what flush finds still undecoded."""

    texts: Sequence[str]
    pending: str = ""
    eos_text: str = ""

    def add(self, token_id: int) -> str:
        return self.eos_text if token_id == EOS else self.texts[token_id]

    def flush(self) -> str:
        pending, self.pending = self.pending, ""
        return pending


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def tracker_for(
    texts: Sequence[str], pending: str = "", clock: FakeClock | None = None, **rules: Any
) -> OutputTracker:
    rules.setdefault("max_new_tokens", 100)
    criteria = StopCriteria(eos_token_ids=frozenset({EOS}), **rules)
    return OutputTracker(criteria, ChunkSource(texts, pending), clock or FakeClock())


def feed(tracker: OutputTracker, token_ids: Sequence[int]) -> list[TokenEvent]:
    """Feed tokens until the tracker stops; return every outcome."""
    outcomes = []
    for token_id in token_ids:
        outcomes.append(tracker.on_token(token_id))
        if outcomes[-1].finished:
            break
    return outcomes


def run(texts: Sequence[str], **rules: Any) -> tuple[list[TokenEvent], OutputTracker]:
    tracker = tracker_for(texts, **rules)
    return feed(tracker, range(len(texts))), tracker


def joined(outcomes: Sequence[TokenEvent]) -> str:
    return "".join(o.text for o in outcomes)


# --- stop-sequence matching (§5.3) ---


def test_stop_sequence_within_one_token_included() -> None:
    outcomes, tracker = run(["Hello", " world", ".", " More"], stop_sequences=("world",))
    assert joined(outcomes) == "Hello world"
    assert outcomes[-1].stop_reason == StopReason.STOP_SEQUENCE
    assert outcomes[-1].stop_sequence == "world"
    assert outcomes[-1].generated_token_count == 2
    assert tracker.released_text == "Hello world"


def test_stop_sequence_excluded_trims_it() -> None:
    outcomes, _ = run(["Hello", " world", "."], stop_sequences=(" world",), include_stop_sequence=False)
    assert joined(outcomes) == "Hello"
    assert outcomes[-1].stop_sequence == " world"
    assert outcomes[-1].generated_token_count == 2


def test_stop_sequence_spanning_tokens() -> None:
    outcomes, _ = run(["The ", "lazy", " d", "og", " sleeps"], stop_sequences=("y do",))
    assert joined(outcomes) == "The lazy do"
    assert outcomes[-1].generated_token_count == 4
    assert outcomes[-1].stop_reason == StopReason.STOP_SEQUENCE


def test_stop_sequence_spanning_three_tokens_excluded() -> None:
    outcomes, _ = run(
        ["a", "<", "|", "end", "|>", "zz"], stop_sequences=("<|end|>",), include_stop_sequence=False
    )
    assert joined(outcomes) == "a"
    assert outcomes[-1].generated_token_count == 5


def test_stop_inside_token_cuts_mid_token() -> None:
    outcomes, _ = run(["I am", " confused", " now"], stop_sequences=("confu",))
    assert joined(outcomes) == "I am confu"
    assert outcomes[-1].generated_token_count == 2


def test_stop_inside_token_excluded_cuts_before_it() -> None:
    outcomes, _ = run(["I am", " confused"], stop_sequences=("confu",), include_stop_sequence=False)
    assert joined(outcomes) == "I am "


def test_first_listed_stop_sequence_wins_over_earlier_position() -> None:
    # "cat" starts earlier in the text, but "dog" is listed first.
    outcomes, _ = run(["a cat and a dog"], stop_sequences=("dog", "cat"))
    assert joined(outcomes) == "a cat and a dog"
    assert outcomes[-1].stop_sequence == "dog"


def test_rightmost_occurrence_touching_new_text_is_used() -> None:
    included, _ = run(["x", "abcab", "z"], stop_sequences=("ab",))
    excluded, _ = run(["x", "abcab", "z"], stop_sequences=("ab",), include_stop_sequence=False)
    assert joined(included) == "xabcab"
    assert joined(excluded) == "xabc"


def test_occurrence_wholly_in_earlier_text_is_not_detected() -> None:
    # "stop" lies inside the first two tokens, which are still under min_new_tokens.
    outcomes, _ = run(
        ["st", "op", " go", " on"], stop_sequences=("stop",), min_new_tokens=3, max_new_tokens=4
    )
    assert joined(outcomes) == "stop go on"
    assert outcomes[-1].stop_reason == StopReason.MAX_TOKENS


def test_occurrence_started_under_min_tokens_detected_when_completed_after() -> None:
    outcomes, _ = run(["st", "op", " go"], stop_sequences=("stop",), min_new_tokens=2)
    assert outcomes[-1].stop_reason == StopReason.STOP_SEQUENCE
    assert joined(outcomes) == "stop"
    assert outcomes[-1].generated_token_count == 2


def test_stop_match_during_min_tokens_is_not_checked() -> None:
    outcomes, _ = run(["stop", " later", " stop", "!"], stop_sequences=("stop",), min_new_tokens=2)
    assert joined(outcomes) == "stop later stop"
    assert outcomes[-1].generated_token_count == 3


def test_emoji_stop_sequence() -> None:
    texts = ["party", " 🎉", " time"]
    included, _ = run(texts, stop_sequences=("🎉",))
    excluded, _ = run(texts, stop_sequences=("🎉",), include_stop_sequence=False)
    assert joined(included) == "party 🎉"
    assert joined(excluded) == "party "
    assert included[-1].stop_sequence == "🎉"


def test_multibyte_stop_sequence_spanning_tokens_reported_as_supplied() -> None:
    outcomes, _ = run(["Ça", " vé", "rifie", " ça"], stop_sequences=("über", "érif"))
    assert joined(outcomes) == "Ça vérif"
    assert outcomes[-1].stop_sequence == "érif"


def test_token_adding_no_text_never_matches() -> None:
    outcomes, _ = run(["end", "", ""], stop_sequences=("x",), max_new_tokens=3)
    assert outcomes[-1].stop_reason == StopReason.MAX_TOKENS


# --- precedence (§5.6) ---


def test_stop_completed_by_last_allowed_token_reports_max_tokens_untrimmed() -> None:
    outcomes, _ = run(
        ["one", " two", " three"], stop_sequences=("two",), include_stop_sequence=False, max_new_tokens=2
    )
    assert outcomes[-1].stop_reason == StopReason.MAX_TOKENS
    assert outcomes[-1].stop_sequence is None
    assert joined(outcomes) == "one two"


def test_clamped_limit_reports_token_limit() -> None:
    outcomes, _ = run(["a", "b", "c"], max_new_tokens=2, max_tokens_clamped=True)
    assert outcomes[-1].stop_reason == StopReason.TOKEN_LIMIT
    assert outcomes[-1].generated_token_count == 2


def test_eos_stops_counted_and_renders_no_text() -> None:
    tracker = tracker_for(["Hi", " there"], pending="")
    outcomes = feed(tracker, [0, 1, EOS])
    assert outcomes[-1].stop_reason == StopReason.EOS_TOKEN
    assert outcomes[-1].generated_token_count == 3
    assert joined(outcomes) == "Hi there"
    assert outcomes[-1].stop_sequence is None


def test_a_request_own_stop_ids_end_it_as_eos_does() -> None:
    params = StoppingParams(max_new_tokens=10, stop_token_ids=(1,))
    criteria = StopCriteria.from_params(params, eos_token_ids=frozenset({EOS}), arrival_time=0.0)
    assert criteria.eos_token_ids == {EOS, 1}
    outcomes = feed(OutputTracker(criteria, ChunkSource(["Hi", " there"])), [0, 1])
    assert outcomes[-1].stop_reason == StopReason.EOS_TOKEN and outcomes[-1].generated_token_count == 2
    assert joined(outcomes) == "Hi"


def test_trailing_eos_not_rendered_even_with_special_tokens() -> None:
    tracker = OutputTracker(
        StopCriteria(max_new_tokens=10, eos_token_ids=frozenset({EOS})), ChunkSource(["a"], eos_text="</s>")
    )
    assert joined(feed(tracker, [0, EOS])) == "a"


def test_eos_during_min_tokens_suppressed_by_precedence() -> None:
    tracker = tracker_for(["a", "b"], min_new_tokens=3)
    outcomes = feed(tracker, [0, EOS, 1, EOS])
    assert [o.stop_reason for o in outcomes] == [StopReason.NOT_FINISHED] * 3 + [StopReason.EOS_TOKEN]
    assert outcomes[-1].generated_token_count == 4
    assert joined(outcomes) == "ab"


def test_eos_beats_max_tokens_on_same_token() -> None:
    tracker = tracker_for(["a"], max_new_tokens=2)
    assert feed(tracker, [0, EOS])[-1].stop_reason == StopReason.EOS_TOKEN


def test_time_limit_before_min_tokens() -> None:
    clock = FakeClock()
    tracker = tracker_for(["a", "b", "c"], clock=clock, min_new_tokens=5, deadline=1.0)
    assert tracker.on_token(0).stop_reason == StopReason.NOT_FINISHED
    clock.now = 1.5
    outcome = tracker.on_token(1)
    assert outcome.stop_reason == StopReason.TIME_LIMIT
    assert outcome.generated_token_count == 2
    assert tracker.released_text == "ab"


def test_time_limit_beats_stop_sequence_and_keeps_text_untrimmed() -> None:
    clock = FakeClock(now=2.0)
    tracker = tracker_for(
        ["go", " stop"], clock=clock, deadline=1.0, stop_sequences=("stop",), include_stop_sequence=False
    )
    outcome = tracker.on_token(0)
    assert (outcome.stop_reason, outcome.text, outcome.generated_token_count) == (
        StopReason.TIME_LIMIT,
        "go",
        1,
    )


def test_eos_after_deadline_reports_time_limit_without_rendering() -> None:
    source = ChunkSource(["a"], eos_text="</s>")
    criteria = StopCriteria(max_new_tokens=5, eos_token_ids=frozenset({EOS}), deadline=1.0)
    clock = FakeClock()
    tracker = OutputTracker(criteria, source, clock)
    tracker.on_token(0)
    clock.now = 3.0
    assert tracker.on_token(EOS).stop_reason == StopReason.TIME_LIMIT
    assert tracker.released_text == "a"


def test_on_token_after_stop_raises() -> None:
    _, tracker = run(["a"], max_new_tokens=1)
    with pytest.raises(RuntimeError):
        tracker.on_token(0)


# --- pending detokenizer text and external stops ---


def test_stop_flushes_pending_detokenizer_text() -> None:
    tracker = tracker_for(["a", "b"], pending="é", max_new_tokens=2)
    assert joined(feed(tracker, [0, 1])) == "abé"


def test_stop_sequence_discards_pending_detokenizer_text() -> None:
    tracker = tracker_for(["a", "b"], pending="é", stop_sequences=("b",))
    assert joined(feed(tracker, [0, 1])) == "ab"


def test_cancel_releases_held_text() -> None:
    tracker = tracker_for(["Hello", " wor", "ld"], pending="!", stop_sequences=("xyz",))
    streamed = joined(feed(tracker, [0, 1, 2]))
    outcome = tracker.finish_now(StopReason.CANCELLED)
    assert outcome.stop_reason == StopReason.CANCELLED
    assert outcome.generated_token_count == 3
    assert streamed + outcome.text == "Hello world!"


def test_deadline_passed_while_queued_gives_nothing() -> None:
    tracker = tracker_for([], deadline=0.0)
    outcome = tracker.finish_now(StopReason.TIME_LIMIT)
    assert (outcome.stop_reason, outcome.text, outcome.generated_token_count) == (
        StopReason.TIME_LIMIT,
        "",
        0,
    )


# --- streaming release (§5.4, §5.1.3) ---


def test_without_stop_sequences_only_last_grapheme_is_held() -> None:
    outcomes, tracker = run(["Hello", " world"])
    assert [o.text for o in outcomes] == ["Hell", "o worl"]
    assert tracker.finish_now(StopReason.CANCELLED).text == "d"


def test_include_stop_holds_newest_token() -> None:
    outcomes, tracker = run(["ab", "cd", "ef", "!"], stop_sequences=("zz",))
    assert [o.text for o in outcomes] == ["", "ab", "cd", "ef"]
    assert tracker.finish_now(StopReason.CANCELLED).text == "!"


def test_exclude_stop_holds_back_longest_sequence_bytes() -> None:
    outcomes, _ = run(["a", "b", "c", "d", "e"], stop_sequences=("x", "wxyz"), include_stop_sequence=False)
    # H = 4: text is released up to the token boundary at least 4 bytes before the end.
    assert [o.text for o in outcomes] == ["", "", "", "", "a"]


def test_hold_back_counts_bytes_not_characters() -> None:
    # "é" is two bytes, so H = 2 and after "xy" only the empty boundary qualifies.
    outcomes, _ = run(["x", "y", "z", "w"], stop_sequences=("é",), include_stop_sequence=False)
    assert [o.text for o in outcomes] == ["", "", "x", "y"]


def test_exclude_stop_hold_back_never_releases_trimmed_text() -> None:
    texts = ["The", " end", " E", "N", "D", "!"]
    tracker = tracker_for(texts, stop_sequences=("END!",), include_stop_sequence=False)
    released_before_stop = []
    for token_id in range(len(texts)):
        outcome = tracker.on_token(token_id)
        if outcome.finished:
            break
        released_before_stop.append(tracker.released_text)
    assert outcome.stop_reason == StopReason.STOP_SEQUENCE
    assert tracker.released_text == "The end "
    assert all("E" not in released for released in released_before_stop)


def test_grapheme_hold_back_of_skin_tone_emoji_split_over_tokens() -> None:
    outcomes, tracker = run(["ok ", "👍", "🏽", " yes"])
    final = tracker.finish_now(StopReason.CANCELLED)
    deltas = [o.text for o in outcomes] + [final.text]
    assert deltas == ["ok", " ", "", "👍🏽 ye", "s"]


def test_release_never_splits_a_grapheme_at_the_token_limit() -> None:
    # "e" + combining acute: the token boundary between them is not a grapheme boundary.
    outcomes, _ = run(["ab", "e", "\u0301", "c", "d"], stop_sequences=("zz",))
    assert [o.text for o in outcomes] == ["", "ab", "", "e\u0301", "c"]


def test_tracker_over_real_detokenizer_cuts_emoji_modifier(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Let us")
    generated = tokenizer.encode(" party 👍🏽 all night")
    criteria = StopCriteria(max_new_tokens=50, stop_sequences=("🏽",), include_stop_sequence=False)
    source = for_tokenizer(tokenizer, prompt, decoder_only=True, skip_special_tokens=True)
    tracker = OutputTracker(criteria, source)
    outcomes = feed(tracker, generated)
    assert outcomes[-1].stop_reason == StopReason.STOP_SEQUENCE
    assert joined(outcomes) == tracker.released_text == " party 👍"


# --- criteria ---


def test_hold_back_bytes_per_mode() -> None:
    assert StopCriteria(max_new_tokens=5).hold_back_bytes == 0
    assert StopCriteria(max_new_tokens=5, stop_sequences=("abc",)).hold_back_bytes == 1
    excluded = StopCriteria(max_new_tokens=5, stop_sequences=("ab", "👍"), include_stop_sequence=False)
    assert excluded.hold_back_bytes == 4


def test_empty_stop_sequence_rejected() -> None:
    with pytest.raises(ValueError):
        StopCriteria(max_new_tokens=5, stop_sequences=("a", ""))


def test_criteria_from_params_sets_deadline_and_clamp() -> None:
    params = StoppingParams(max_new_tokens=50, min_new_tokens=2, time_limit_millis=250, stop_sequences=("x",))
    criteria = StopCriteria.from_params(
        params, eos_token_ids=frozenset({2}), arrival_time=10.0, max_new_tokens=30
    )
    assert criteria.deadline == pytest.approx(10.25)
    assert (criteria.max_new_tokens, criteria.max_tokens_clamped) == (30, True)
    unclamped = StopCriteria.from_params(
        StoppingParams(), eos_token_ids=frozenset(), arrival_time=0.0, max_new_tokens=20
    )
    assert (unclamped.max_tokens_clamped, unclamped.deadline) == (False, None)


# --- properties against a brute-force reference of §5.3 / §5.6 ---


@dataclass(frozen=True)
class Expected:
    text: str
    reason: StopReason
    stop_sequence: str | None
    tokens: int


def reference(
    chunks: Sequence[str], stops: Sequence[str], include: bool, min_new: int, max_new: int
) -> Expected:
    """SPEC §5.3 and §5.6 written plainly over UTF-8 bytes (no EOS, no deadline)."""
    out = b""
    for count, chunk in enumerate(chunks, start=1):
        new = chunk.encode()
        out += new
        if count < min_new:
            continue
        if count >= max_new:
            return Expected(out.decode(), StopReason.MAX_TOKENS, None, count)
        for stop in stops:
            s = stop.encode()
            hits = [
                p
                for p in range(len(out) - len(s) + 1)
                if out[p : p + len(s)] == s and p + len(s) > len(out) - len(new)
            ]
            if hits:
                cut = max(hits) + (len(s) if include else 0)
                return Expected(out[:cut].decode(), StopReason.STOP_SEQUENCE, stop, count)
    return Expected(out.decode(), StopReason.CANCELLED, None, len(chunks))


ALPHABET = ["a", "b", " ", "é", "👍", "🏽", "\u0301", "🇫", "🇷", "\u200d", "😀"]
pieces = st.text(alphabet=st.sampled_from(ALPHABET), max_size=4)


def grapheme_boundaries(text: str) -> set[int]:
    return {0} | {m.end() for m in regex.finditer(r"\X", text)}


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(pieces, max_size=14),
    stops=st.lists(st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=3), max_size=3),
    include=st.booleans(),
    min_new=st.integers(0, 4),
    max_new=st.integers(1, 16),
)
def test_deltas_match_reference_and_never_retract(
    chunks: list[str], stops: list[str], include: bool, min_new: int, max_new: int
) -> None:
    tracker = tracker_for(
        chunks,
        stop_sequences=tuple(stops),
        include_stop_sequence=include,
        min_new_tokens=min_new,
        max_new_tokens=max_new,
    )
    released: list[str] = []
    deltas: list[str] = []
    for token_id in range(len(chunks)):
        outcome = tracker.on_token(token_id)
        deltas.append(outcome.text)
        released.append(tracker.released_text)
        if outcome.finished:
            break
    else:
        outcome = tracker.finish_now(StopReason.CANCELLED)
        deltas.append(outcome.text)
    expected = reference(chunks, stops, include, min_new, max_new)
    assert "".join(deltas) == tracker.released_text == expected.text
    assert (outcome.stop_reason, outcome.stop_sequence, outcome.generated_token_count) == (
        expected.reason,
        expected.stop_sequence,
        expected.tokens,
    )
    assert all(expected.text.startswith(prefix) for prefix in released)
    # While running, release stops at grapheme boundaries of everything generated later.
    untrimmed = "".join(chunks)
    boundaries = grapheme_boundaries(untrimmed)
    assert all(len(prefix) in boundaries for prefix in released[:-1])
