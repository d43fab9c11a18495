"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's tail."""

from __future__ import annotations

import pytest

from tgis.speculation.ngram import SINGLE_TOKEN_DRAFT, NgramIndex


def test_the_longest_tail_seen_before_wins() -> None:
    #         0  1  2  3  4  5  6  7  8  9
    index = NgramIndex([5, 6, 7, 8, 1, 6, 7, 2, 5, 6, 7], max_ngram=3, min_ngram=2)
    # tail (5, 6, 7) occurred at 0..2, followed by 8; the shorter (6, 7) last occurred before 2
    assert index.propose(3) == (8, 1, 6)


def test_the_latest_earlier_occurrence_is_followed() -> None:
    index = NgramIndex([1, 2, 9, 1, 2, 4, 1, 2], max_ngram=2, min_ngram=2)
    assert index.propose(1) == (4,)


def test_a_proposal_that_reaches_the_end_of_what_is_known_continues_the_repetition() -> None:
    index = NgramIndex([3, 4, 5, 3, 4], max_ngram=2, min_ngram=2)
    assert index.propose(3) == (5, 3, 4)
    assert index.propose(8) == (5, 3, 4, 5, 3, 4, 5, 3)  # the period of 3 goes on
    loop = NgramIndex([9, 1, 7, 7, 7], max_ngram=2, min_ngram=2)
    assert loop.propose(4) == (7, 7, 7, 7)  # (7, 7) was last followed by the newest token itself


def test_a_single_matching_token_proposes_a_short_draft_when_no_longer_tail_was_seen() -> None:
    #                  0  1  2  3  4  5  6  7  8
    index = NgramIndex([4, 7, 1, 2, 3, 5, 6, 9, 4])
    # no earlier (9, 4), but 4 occurred at 0, followed by 7, 1, 2, ...
    assert index.propose(8) == (7, 1, 2, 3, 5, 6, 9, 4)[:SINGLE_TOKEN_DRAFT]
    assert index.propose(2) == (7, 1)
    longer = NgramIndex([4, 7, 1, 2, 3, 5, 6, 9, 4, 7])  # (4, 7) was seen: its draft is not cut short
    assert longer.propose(8) == (1, 2, 3, 5, 6, 9, 4, 7)
    assert NgramIndex([4, 7, 1, 4], min_ngram=2).propose(4) == ()


def test_no_earlier_occurrence_no_proposal() -> None:
    assert NgramIndex([1, 2, 3, 4]).propose(4) == ()
    assert NgramIndex([]).propose(4) == ()


def test_tokens_added_later_are_indexed_as_if_given_at_once() -> None:
    tokens = [7, 8, 9, 1, 7, 8, 2, 3, 7, 8, 9, 4, 7, 8]
    whole = NgramIndex(tokens)
    piecewise = NgramIndex(tokens[:5])
    for token in tokens[5:]:
        piecewise.extend([token])
    assert piecewise.propose(4) == whole.propose(4) == (9, 4, 7, 8)


def test_n_gram_lengths_are_checked() -> None:
    with pytest.raises(ValueError, match="n-gram lengths"):
        NgramIndex([], max_ngram=2, min_ngram=3)
