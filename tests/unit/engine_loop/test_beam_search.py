"""transformers' beam rules in `BeamSearch`, driven with fabricated log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from tgis.engine_loop.beam_search import BeamSearch, Continuation
from tgis.types import BeamParams

END = 0


def logits(*rows: dict[int, float], vocab: int = 8) -> torch.Tensor:
    """Rows whose log-softmax gives each listed token its log-probability (a row's listed ones sum to 1)."""
    out = torch.full((len(rows), vocab), -30.0)
    for i, row in enumerate(rows):
        for token, p in row.items():
            out[i, token] = math.log(p)
    return out


def search(width: int = 2, max_new: int = 5, **beam: object) -> BeamSearch:
    return BeamSearch(BeamParams(width, **beam), max_new_tokens=max_new, ending_ids=frozenset({END}))  # type: ignore[arg-type]


def test_the_first_step_branches_one_beam_into_the_best_continuations() -> None:
    s = search(width=3)
    assert s.advance(logits({1: 0.5, 2: 0.3, 3: 0.15, 7: 0.05})) == [
        Continuation(0, 1),
        Continuation(0, 2),
        Continuation(0, 3),
    ]
    assert s.running == [[1], [2], [3]] and not s.finished
    # the next step ranks every beam's continuations by their summed log-probabilities
    nxt = s.advance(logits({4: 0.55, 5: 0.45}, {4: 0.9, 7: 0.1}, {6: 1.0}))
    assert nxt == [Continuation(0, 4), Continuation(1, 4), Continuation(0, 5)]  # .275, .27, .225
    assert s.running == [[1, 4], [2, 4], [1, 5]]


def test_an_ending_among_the_first_width_candidates_finishes_with_its_length_penalised_score() -> None:
    s = search(width=2, length_penalty=2.0)
    s.advance(logits({1: 0.6, 2: 0.4}))
    s.advance(logits({END: 0.9, 3: 0.1}, {4: 0.55, 5: 0.45}))
    (done,) = s.finished
    assert done.token_ids == (1, END) and done.ended
    assert done.cumulative_logprob == pytest.approx(math.log(0.6 * 0.9), abs=1e-4)
    assert done.score == pytest.approx(done.cumulative_logprob / 2**2.0, abs=1e-4)
    assert s.running == [[2, 4], [2, 5]]  # the ended one does not run on; the next best do


def test_an_ending_ranked_below_width_is_not_kept() -> None:
    s = search(width=1)
    s.advance(logits({1: 0.7, END: 0.3}))  # the ending ranks second of two kept, width is 1
    assert not s.finished and s.running == [[1]]


def test_early_stopping_true_ends_once_width_beams_have_finished() -> None:
    s = search(width=2, early_stopping=True)
    s.advance(logits({1: 0.5, 2: 0.5}))
    assert s.advance(logits({END: 0.6, 3: 0.4}, {END: 0.6, 4: 0.4})) == []
    assert s.done and len(s.finished) == 2


def test_early_stopping_false_ends_when_no_running_beam_can_beat_the_worst_finished() -> None:
    s = search(width=2, max_new=10)
    s.advance(logits({END: 0.5, 1: 0.3, 2: 0.2}))  # (END) finishes: log .5 / 1 = -0.69
    assert not s.done and s.running == [[1], [2]]
    s.advance(logits({END: 0.9, 3: 0.1}, {4: 0.5, 5: 0.5}))  # (1, END) finishes: log .27 / 2 = -0.65
    # the best running beam, log .1 / 2 = -1.15, cannot beat -0.69 any more
    assert s.done
    assert [b.token_ids for b in s.best(2)] == [(1, END), (END,)]


def test_never_with_a_positive_penalty_judges_at_the_longest_length() -> None:
    # At length 2 the running beam cannot beat the finished ones, but at max_new it could: "never" goes on.
    finished_first = [logits({END: 0.5, 1: 0.3, 2: 0.2}), logits({END: 0.9, 3: 0.1}, {4: 0.5, 5: 0.5})]
    never, default = search(width=2, max_new=50, early_stopping="never"), search(width=2, max_new=50)
    for step in finished_first:
        never.advance(step.clone())
        default.advance(step.clone())
    assert default.done and not never.done


def test_the_token_budget_finishes_the_best_width_beams() -> None:
    s = search(width=2, max_new=2, length_penalty=0.0)
    s.advance(logits({1: 0.6, 2: 0.4}))
    assert s.advance(logits({3: 0.5, 4: 0.5}, {5: 0.9, 6: 0.1})) == []
    assert s.done
    assert [b.token_ids for b in s.best(2)] == [(2, 5), (1, 3)]
    assert not any(b.ended for b in s.finished)
    with pytest.raises(ValueError, match="ended"):
        s.advance(logits({1: 1.0}))


def test_min_new_tokens_and_bad_words_ban_before_ranking() -> None:
    s = BeamSearch(
        BeamParams(2),
        max_new_tokens=5,
        ending_ids=frozenset({END}),
        min_new_tokens=1,
        bad_words=((9, 1),),
        context=(9,),
    )
    s.advance(logits({END: 0.5, 1: 0.3, 2: 0.15, 3: 0.05}, vocab=10))  # END and 1 (after 9) are banned
    assert s.running == [[2], [3]] and not s.finished
