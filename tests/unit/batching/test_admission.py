"""Dynamic batching group selection: min group size, FIFO, skips, cut-off, queue jumps (SPEC §6.2–§6.3)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from tgis.batching.admission import (
    QUEUE_JUMP_WINDOW_SECONDS,
    Admission,
    BatchWeights,
    Candidate,
    Selection,
    SequenceShape,
    Unlimited,
    prefill_limit,
)
from tgis.batching.batch_weights import MemoryCoefficients, PaddedWeights, UnpaddedWeights


@dataclass
class TokenBudget:
    """Fabricated weights: worst = Σ(in + out) against `total`; a prefill fits while Σ in(group) ≤
    `prefill_tokens` (its weight is scaled so that the limit is that many tokens); the running batch's initial
    weight is Σ in · `initial_scale` (0 by default: running requests leave the prefill limit alone);
    the granular check answers `granular`."""

    total: float = 1e9
    prefill_tokens: float = math.inf
    initial_scale: float = 0.0
    granular: bool = False
    max_prefill_padding: float = 1.0
    prefill_groups: list[int] = field(default_factory=list)
    initial_batches: list[int] = field(default_factory=list)

    @property
    def max_weight(self) -> float:
        return self.total

    def worst(self, batch: Sequence[SequenceShape]) -> float:
        return sum(s.input_length + s.remaining_new_tokens for s in batch)

    def initial(self, batch: Sequence[SequenceShape]) -> float:
        self.initial_batches.append(len(batch))
        return sum(s.input_length for s in batch) * self.initial_scale

    def prefill(self, group: Sequence[SequenceShape]) -> float:
        self.prefill_groups.append(len(group))
        return sum(s.input_length for s in group) * self.total / self.prefill_tokens

    def padding(self, group: Sequence[SequenceShape]) -> float:
        return 0.0

    def granular_fits(self, batch: Sequence[SequenceShape], candidate: SequenceShape) -> bool:
        return self.granular


def shape(tokens_in: int, tokens_out: int = 0) -> SequenceShape:
    return SequenceShape(input_length=tokens_in, remaining_new_tokens=tokens_out)


def queued(tokens_in: int, at: float = 0.0, tokens_out: int = 0) -> Candidate:
    return Candidate(shape=shape(tokens_in, tokens_out), queued_at=at)


def scheduler(
    max_batch_size: int = 12, weights: BatchWeights | None = None, max_waiting_tokens: int = 24
) -> Admission:
    return Admission(
        max_batch_size=max_batch_size,
        max_waiting_tokens=max_waiting_tokens,
        weights=weights if weights is not None else Unlimited(),
    )


# ---------------------------------------------------------------- min_group_size (§6.2 b)


@pytest.mark.parametrize("running", [0, 1])
@pytest.mark.parametrize("steps", [1, 5, 23, 24, 100])
def test_min_group_size_is_one_with_at_most_one_running(running: int, steps: int) -> None:
    assert scheduler().min_group_size(running, steps) == 1


@pytest.mark.parametrize("steps", [24, 25, 1000])
def test_min_group_size_is_one_once_max_waiting_tokens_steps_have_passed(steps: int) -> None:
    assert scheduler(max_waiting_tokens=24).min_group_size(8, steps) == 1


@pytest.mark.parametrize(
    ("running", "steps", "expected"),
    [
        (8, 1, 7),  # ⌊8·23/24⌋ = 7
        (8, 12, 4),  # ⌊8·12/24⌋ = 4
        (8, 21, 1),  # ⌊8·3/24⌋ = 1
        (8, 22, 1),  # ⌊8·2/24⌋ = 0 → max(1, 0) = 1
        (8, 23, 1),
        (12, 18, 3),  # ⌊12·6/24⌋ = 3
        (12, 1, 11),  # ⌊12·23/24⌋ = 11
        (2, 1, 1),  # ⌊2·23/24⌋ = 1
        (24, 1, 23),
    ],
)
def test_min_group_size_formula(running: int, steps: int, expected: int) -> None:
    assert scheduler(max_waiting_tokens=24).min_group_size(running, steps) == expected


def test_min_group_size_with_other_max_waiting_tokens() -> None:
    # ⌊10·(4 − 1)/4⌋ = 7; ⌊10·(4 − 3)/4⌋ = 2
    assert scheduler(max_waiting_tokens=4).min_group_size(10, 1) == 7
    assert scheduler(max_waiting_tokens=4).min_group_size(10, 3) == 2
    assert scheduler(max_waiting_tokens=4).min_group_size(10, 4) == 1


def test_min_group_size_shrinks_as_steps_accumulate() -> None:
    sizes = [scheduler().min_group_size(12, w) for w in range(1, 30)]
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == 11 and sizes[-1] == 1


# ---------------------------------------------------------------- select: size limits and FIFO


def test_empty_queue_selects_nothing() -> None:
    assert scheduler().select([], [], 1) == Selection()


def test_select_takes_everything_in_fifo_order_when_unlimited() -> None:
    waiting = [queued(5 + i, at=float(i)) for i in range(4)]
    selection = scheduler().select(waiting, [], 1)
    assert selection.indices == [0, 1, 2, 3]
    assert selection.queue_jumps == 0


def test_select_stops_at_max_batch_size() -> None:
    waiting = [queued(5) for _ in range(5)]
    assert scheduler(max_batch_size=3).select(waiting, [], 1).indices == [0, 1, 2]


def test_select_counts_running_requests_against_max_batch_size() -> None:
    waiting = [queued(5) for _ in range(5)]
    running = [shape(10, 10), shape(10, 10)]
    assert scheduler(max_batch_size=3).select(waiting, running, 1).indices == [0]


def test_select_nothing_when_batch_is_full() -> None:
    running = [shape(10, 10)] * 3
    assert scheduler(max_batch_size=3).select([queued(5)], running, 1).indices == []


def test_select_nothing_when_fewer_waiting_than_min_size() -> None:
    waiting = [queued(5), queued(5)]
    assert scheduler().select(waiting, [shape(1, 1)] * 4, 3) == Selection()


def test_select_nothing_when_min_size_would_overflow_max_batch_size() -> None:
    waiting = [queued(5) for _ in range(5)]
    running = [shape(10, 10)] * 3
    # 3 running + min 2 > 4, even though one more would fit.
    assert scheduler(max_batch_size=4).select(waiting, running, 2) == Selection()
    assert scheduler(max_batch_size=4).select(waiting, running, 1).indices == [0]


def test_select_with_exactly_min_size_waiting() -> None:
    waiting = [queued(5), queued(5), queued(5)]
    assert scheduler().select(waiting, [shape(1, 1)] * 4, 3).indices == [0, 1, 2]


def test_min_size_is_a_precondition_not_a_cap() -> None:
    waiting = [queued(5) for _ in range(6)]
    assert scheduler(max_batch_size=10).select(waiting, [shape(1, 1)] * 2, 2).indices == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------- select: weights, skips, cut-off


def test_entries_that_fit_the_weight_limit_are_all_accepted() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(10, tokens_out=10, at=i) for i in range(5)]  # 20 each → exactly 100
    assert scheduler(weights=weights).select(waiting, [], 1).indices == [0, 1, 2, 3, 4]


def test_running_requests_count_towards_the_weight_limit() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(10, tokens_out=10, at=i) for i in range(5)]
    running = [shape(30, 30)]  # 60 used → room for two 20-token entries
    assert scheduler(weights=weights).select(waiting, running, 1).indices == [0, 1]


def test_chosen_entries_count_towards_the_weight_limit() -> None:
    weights = TokenBudget(total=50)
    waiting = [queued(20, tokens_out=10, at=0.0), queued(20, tokens_out=10, at=0.1)]
    selection = scheduler(weights=weights).select(waiting, [], 1)
    assert selection.indices == [0]  # the second one would bring the batch to 60


def test_small_requests_jump_a_big_one_within_the_window() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(200, at=10.0), queued(10, at=10.2), queued(10, at=10.9)]
    selection = scheduler(weights=weights).select(waiting, [], 1)
    assert selection.indices == [1, 2]
    assert selection.queue_jumps == 2


def test_scan_stops_at_cut_off_one_second_after_first_skipped_entry() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(200, at=10.0), queued(10, at=10.5), queued(10, at=11.5), queued(10, at=11.6)]
    selection = scheduler(weights=weights).select(waiting, [], 1)
    assert selection.indices == [1]
    assert selection.queue_jumps == 1


def test_entry_queued_exactly_at_cut_off_is_still_considered() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(200, at=0.0), queued(10, at=QUEUE_JUMP_WINDOW_SECONDS)]
    assert QUEUE_JUMP_WINDOW_SECONDS == 1.0
    assert scheduler(weights=weights).select(waiting, [], 1).indices == [1]


def test_cut_off_is_set_by_the_first_skipped_entry_only() -> None:
    weights = TokenBudget(total=100)
    waiting = [
        queued(200, at=0.0),  # skipped → cut-off 1.0
        queued(10, at=0.5),  # jumps
        queued(300, at=0.9),  # skipped again; cut-off stays 1.0 (not 1.9)
        queued(10, at=1.5),  # after the cut-off: scan stops
    ]
    selection = scheduler(weights=weights).select(waiting, [], 1)
    assert selection.indices == [1]
    assert selection.queue_jumps == 1


def test_no_queue_jump_counted_before_the_first_skip() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(10, at=0.0), queued(10, at=0.1), queued(500, at=0.2), queued(10, at=0.3)]
    selection = scheduler(weights=weights).select(waiting, [], 1)
    assert selection.indices == [0, 1, 3]
    assert selection.queue_jumps == 1


def test_skip_then_max_batch_size_stops_the_scan() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(500, at=0.0), queued(10, at=0.1), queued(10, at=0.2), queued(10, at=0.3)]
    selection = scheduler(max_batch_size=2, weights=weights).select(waiting, [], 1)
    assert selection.indices == [1, 2]
    assert selection.queue_jumps == 2


def test_nothing_fits_selects_nothing() -> None:
    weights = TokenBudget(total=100)
    waiting = [queued(500, at=0.0), queued(600, at=0.1)]
    assert scheduler(weights=weights).select(waiting, [], 1) == Selection()


def test_prefill_limit_skips_entry_and_sets_cut_off() -> None:
    weights = TokenBudget(prefill_tokens=50)
    waiting = [queued(30, at=0.0), queued(30, at=0.1), queued(20, at=0.2), queued(10, at=1.5)]
    selection = scheduler(weights=weights).select(waiting, [], 1)
    # 30 + 30 > 50 → skip #1 (cut-off 1.1); 30 + 20 fits; #3 arrived after the cut-off.
    assert selection.indices == [0, 2]
    assert selection.queue_jumps == 1


def test_prefill_check_sees_running_batch_and_candidate_group() -> None:
    """SPEC §6.3: the running batch sets the prefill limit (its initial weight, once per scan); the
    prefill weight is that of the chosen entries plus the candidate."""
    weights = TokenBudget()
    running = [shape(5, 5), shape(6, 6)]
    scheduler(weights=weights).select([queued(1), queued(2), queued(3)], running, 1)
    assert weights.initial_batches == [2]
    assert weights.prefill_groups == [1, 2, 3]


# ---------------------------------------------------------------- select: giving up on min_size


def test_gives_up_when_skip_leaves_too_few_entries_for_min_size() -> None:
    weights = TokenBudget(total=100)
    running = [shape(10, 10)] * 4  # 80 used
    waiting = [queued(500, at=0.0), queued(5, at=0.1)]
    # After skipping #0 only one entry remains: min_size 2 is unreachable.
    assert scheduler(weights=weights).select(waiting, running, 2) == Selection()


def test_give_up_discards_entries_already_chosen() -> None:
    """TGIS returns no batch at all when min_size becomes unreachable (queue.rs `return None`)."""
    weights = TokenBudget(total=100)
    running = [shape(10, 10)] * 4  # 80 used
    waiting = [queued(5, at=0.0), queued(500, at=0.1), queued(5, at=0.2)]
    # #0 accepted; #1 does not fit and 1 chosen + 1 remaining < 3 → give up.
    assert scheduler(weights=weights).select(waiting, running, 3) == Selection()


def test_skip_allowed_while_min_size_is_still_reachable() -> None:
    weights = TokenBudget(total=100)
    running = [shape(10, 10)] * 4  # 80 used
    waiting = [queued(500, at=0.0), queued(5, at=0.1), queued(5, at=0.2)]
    selection = scheduler(weights=weights).select(waiting, running, 2)
    assert selection.indices == [1, 2]
    assert selection.queue_jumps == 2


def test_min_size_reachable_exactly_with_remaining_entries() -> None:
    weights = TokenBudget(total=100)
    running = [shape(10, 10)] * 2  # 40 used
    waiting = [queued(5, at=0.0), queued(500, at=0.1), queued(5, at=0.2), queued(5, at=0.3)]
    # At #1: 1 chosen + 2 remaining = 3 = min_size → skip, not give up.
    selection = scheduler(weights=weights).select(waiting, running, 3)
    assert selection.indices == [0, 2, 3]
    assert selection.queue_jumps == 2


def test_prefill_limit_skip_does_not_give_up() -> None:
    """SPEC §6.3: only the weight (memory) check gives up; a prefill-limit skip just skips."""
    weights = TokenBudget(prefill_tokens=50)
    running = [shape(10, 10)] * 2
    waiting = [queued(30, at=0.0), queued(30, at=0.1)]
    selection = scheduler(weights=weights).select(waiting, running, 2)
    assert selection.indices == [0]


# ---------------------------------------------------------------- select: SPEC §6.3 with real weights


def unpadded(max_weight: float, a: float = 1.0, e: float = 1.0) -> UnpaddedWeights:
    return UnpaddedWeights(MemoryCoefficients(a=a, b=0.0, c=0.0, d=e, e=e), max_weight, 0.2)


def padded(max_weight: float, max_prefill_padding: float = 0.2) -> PaddedWeights:
    ones = MemoryCoefficients(a=1.0, b=0.0, c=0.0, d=1.0, e=1.0)
    return PaddedWeights(ones, max_weight, max_prefill_padding)


def test_unlimited_weights_admit_anything_up_to_max_batch_size() -> None:
    waiting = [queued(10**6, tokens_out=10**6, at=float(i)) for i in range(5)]
    selection = scheduler(max_batch_size=4).select(waiting, [shape(10**6, 10**6)], 1)
    assert selection == Selection(indices=[0, 1, 2])


def test_granular_check_admits_what_the_worst_case_rejects_and_is_counted() -> None:
    # Running: 10 in, 50 out. Candidate: 10 in, 5 out. Worst case (10+10+50+5)·1 = 75 > 60, but the
    # candidate finishes first: at that point 20 in + 2·5 out = 30; the long one alone peaks at 60.
    running = [shape(10, 50)]
    selection = scheduler(weights=unpadded(60)).select([queued(10, tokens_out=5)], running, 1)
    assert selection == Selection(indices=[0], granular_additions=1)


def test_failed_granular_check_skips_sets_the_cut_off_and_small_ones_jump() -> None:
    running = [shape(10, 50)]
    waiting = [
        queued(10, tokens_out=45, at=0.0),  # at its finish 20 + 2·45 = 110 > 60: skipped, cut-off 1.0
        queued(5, tokens_out=2, at=0.4),  # worst 67 > 60, granular 15 + 2·2 = 19: jumps
        queued(1, tokens_out=1, at=2.0),  # after the cut-off: not considered
    ]
    selection = scheduler(weights=unpadded(60)).select(waiting, running, 1)
    assert selection == Selection(indices=[1], queue_jumps=1, granular_additions=1)


def test_worst_case_that_fits_skips_the_granular_check() -> None:
    selection = scheduler(weights=unpadded(100)).select([queued(10, tokens_out=10)], [shape(10, 10)], 1)
    assert selection == Selection(indices=[0])


def test_prefill_limit_shrinks_with_the_running_batch() -> None:
    # Wmax 100, e = 0.5: the running batch's initial weight is 60·0.5 = 30, so prefills get 70.
    weights = unpadded(100, a=1.0, e=0.5)
    running = [shape(60, 10)]
    waiting = [queued(75, tokens_out=1, at=0.0), queued(70, tokens_out=1, at=0.5)]
    selection = scheduler(weights=weights).select(waiting, running, 1)
    assert selection == Selection(indices=[1], queue_jumps=1, prefill_weight_skips=1)
    # With nothing running the whole Wmax is available to the prefill.
    assert scheduler(weights=weights).select(waiting, [], 1).indices == [0]


def test_prefill_limit_is_floored() -> None:
    # initial = 10·0.25 = 2.5 → limit ⌊(1 − 2.5/100)·100⌋ = 97, not 97.5.
    weights = unpadded(100, a=1.0, e=0.25)
    assert prefill_limit(weights, [shape(10, 1)]) == 97
    assert scheduler(weights=weights).select([queued(98, tokens_out=1)], [shape(10, 1)], 1).indices == []
    assert scheduler(weights=weights).select([queued(97, tokens_out=1)], [shape(10, 1)], 1).indices == [0]


def test_nothing_selected_when_running_batch_leaves_no_prefill_room() -> None:
    weights = unpadded(100, a=0.0, e=1.0)  # prefills weigh nothing, yet the limit is 0
    assert prefill_limit(weights, [shape(100, 0)]) == 0
    assert scheduler(weights=weights).select([queued(1, tokens_out=0)], [shape(100, 0)], 1) == Selection()


def test_prefill_limit_is_wmax_with_nothing_running_and_infinite_when_unlimited() -> None:
    assert prefill_limit(unpadded(123.0), []) == 123.0
    assert prefill_limit(Unlimited(), [shape(10, 10)]) == math.inf


def test_padding_limit_skips_and_is_counted_apart_from_prefill_weight() -> None:
    weights = padded(10**6, max_prefill_padding=0.2)
    waiting = [
        queued(100, tokens_out=1, at=0.0),
        queued(50, tokens_out=1, at=0.1),  # padding (200 − 150)/200 = 0.25 > 0.2: skipped
        queued(90, tokens_out=1, at=0.2),  # padding (300 − 240)/300 = 0.2: accepted (a jump)
    ]
    selection = scheduler(weights=weights).select(waiting, [], 1)
    assert selection == Selection(indices=[0, 2], queue_jumps=1, padding_skips=1)


def test_padding_is_measured_on_the_prefill_group_only() -> None:
    # A long running request does not make the new group's padding worse.
    weights = padded(10**6, max_prefill_padding=0.0)
    selection = scheduler(weights=weights).select([queued(10, tokens_out=1)] * 2, [shape(500, 10)], 1)
    assert selection == Selection(indices=[0, 1])


def test_padded_worst_case_and_granular_check_drive_admission() -> None:
    # Padded, g = 1, Wmax 100. Running (in 40, out 5); candidate (in 10, out 50):
    # worst (40 + 50)·2 = 180 > 100; granular: the candidate alone (10 + 50)·1 = 60, then both at the
    # running one's finish (40 + 5)·2 = 90 ≤ 100 → admitted.
    selection = scheduler(weights=padded(100)).select([queued(10, tokens_out=50)], [shape(40, 5)], 1)
    assert selection == Selection(indices=[0], granular_additions=1)
    # With Wmax 89 the second point (90) does not fit.
    assert scheduler(weights=padded(89)).select([queued(10, tokens_out=50)], [shape(40, 5)], 1) == Selection()


def test_granular_failure_gives_up_when_min_size_is_out_of_reach() -> None:
    running = [shape(10, 50)] * 2
    waiting = [queued(10, tokens_out=49, at=0.0), queued(1, tokens_out=1, at=0.1)]
    assert scheduler(weights=unpadded(60)).select(waiting, running, 2) == Selection()


def test_max_batch_size_stops_the_scan_with_real_weights() -> None:
    waiting = [queued(5, tokens_out=5, at=float(i)) for i in range(6)]
    selection = scheduler(max_batch_size=3, weights=unpadded(1000)).select(waiting, [shape(5, 5)], 1)
    assert selection == Selection(indices=[0, 1])
