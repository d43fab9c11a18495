"""The prompt-token cap of a paged step, learnt from fabricated step timings (no model, no clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tgis.batching.prompt_budget import (
    MAX_STALL,
    MIN_OBSERVATIONS,
    MIN_PROMPT_TOKENS,
    PROMPT_TOKENS_PER_WAITING,
    STALL,
    PromptBudget,
)


def feed(budget: PromptBudget, fixed: float, per_token: float, sizes: list[int], decoding: int = 16) -> None:
    """Steps of `sizes` tokens, `decoding` of each step's sequences decoding (at most its size)."""
    for tokens in sizes:
        budget.observe(tokens, fixed + per_token * tokens, min(decoding, tokens))


MIXED_SIZES = [16, 16, 40, 16, 16, 64, 16, 30, 16, 16, 48, 16] * 3  # decode-only steps and prompt chunks


def test_no_cap_before_the_steps_tell_the_cost_apart() -> None:
    budget = PromptBudget()
    assert budget.cap(decoding=16, prefilling=1) is None
    feed(budget, 0.010, 0.0003, [16] * 50)  # all steps the same size: slope unknowable
    assert budget.step_cost() is None and budget.cap(decoding=16, prefilling=1) is None
    fresh = PromptBudget()
    feed(fresh, 0.010, 0.0003, MIXED_SIZES[: MIN_OBSERVATIONS - 1])
    assert fresh.cap(decoding=16, prefilling=1) is None


def test_a_steady_decode_batch_keeps_the_learnt_slope() -> None:
    """Hundreds of same-size decode steps after the fit say nothing about a prompt token's cost: the
    cap stays what the slope gives (the next long prompt would otherwise go in at MAX_STEP_TOKENS,
    one step every stream waits for), and its fixed part follows the steps as they slow down."""
    budget = PromptBudget()
    feed(budget, 0.010, 0.0003, MIXED_SIZES)
    learnt = budget.cap(decoding=16, prefilling=1)
    assert learnt is not None
    feed(budget, 0.010, 0.0003, [16, 15] * 300, decoding=16)
    variance = budget.mean_tokens_squared - budget.mean_tokens**2
    assert variance < 1.0  # the recent steps alone could no longer tell the slope
    cost = budget.step_cost()
    assert cost is not None and cost == pytest.approx((0.010, 0.0003), rel=1e-6)
    assert budget.cap(decoding=16, prefilling=1) == learnt
    feed(budget, 0.016, 0.0003, [16, 15] * 300, decoding=16)  # longer contexts: each decode step dearer
    slower = budget.step_cost()
    assert slower is not None and slower == pytest.approx((0.016, 0.0003), rel=1e-6)
    slower_cap = budget.cap(decoding=16, prefilling=1)
    assert slower_cap is not None and slower_cap > learnt  # a dearer decode step affords more


def test_steps_that_tell_a_new_slope_replace_the_learnt_one() -> None:
    budget = PromptBudget()
    feed(budget, 0.010, 0.0003, MIXED_SIZES)
    learnt = budget.cap(decoding=16, prefilling=1)
    assert learnt is not None and learnt < 64
    feed(budget, 0.010, 0.000002, MIXED_SIZES * 4)  # tokens now nearly free: MAX_STEP_TOKENS limits
    cap = budget.cap(decoding=16, prefilling=1)
    assert cap is not None and cap > 2048


def test_the_fitted_line_gives_the_prompt_tokens_worth_stall_decode_steps() -> None:
    budget = PromptBudget()
    feed(budget, 0.010, 0.0003, MIXED_SIZES)
    cost = budget.step_cost()
    assert cost is not None
    assert cost[0] == pytest.approx(0.010, rel=1e-6) and cost[1] == pytest.approx(0.0003, rel=1e-6)
    decode_step = 0.010 + 0.0003 * 16
    cap = budget.cap(decoding=16, prefilling=1)
    assert cap is not None and cap == int(STALL * decode_step / 0.0003)
    # what the cap buys: the step with those prompt tokens takes at most 1 + STALL decode steps
    assert 0.010 + 0.0003 * (16 + cap) <= (1 + STALL) * decode_step + 1e-12
    longer = budget.cap(decoding=32, prefilling=1)
    assert longer is not None and longer > cap  # a longer decode step affords more prompt tokens


def test_nothing_decoding_means_no_cap() -> None:
    budget = PromptBudget()
    feed(budget, 0.010, 0.0003, MIXED_SIZES)
    assert budget.cap(decoding=0, prefilling=1) is None


def test_costly_prompt_tokens_still_get_the_minimum() -> None:
    budget = PromptBudget()
    feed(budget, 0.0, 0.002, MIXED_SIZES)  # no fixed cost: a prompt token costs a whole decode token
    assert budget.cap(decoding=16, prefilling=1) == MIN_PROMPT_TOKENS


def test_cheap_tokens_leave_max_step_tokens_the_only_limit() -> None:
    budget = PromptBudget()
    feed(budget, 0.010, 0.000002, MIXED_SIZES)  # GPU-like: hundreds of tokens in one step's time
    cap = budget.cap(decoding=16, prefilling=1)
    assert cap is not None and cap > 2048
    flat = PromptBudget()
    feed(flat, 0.010, 0.0, MIXED_SIZES)
    assert flat.cap(decoding=16, prefilling=1) is None  # tokens cost nothing measurable


def test_the_fit_follows_the_machine_when_steps_get_slower() -> None:
    budget = PromptBudget()
    feed(budget, 0.020, 0.0003, MIXED_SIZES)
    before = budget.cap(decoding=16, prefilling=1)
    feed(budget, 0.020, 0.0009, MIXED_SIZES * 4)  # e.g. another process now shares the cores
    after = budget.cap(decoding=16, prefilling=1)
    assert before is not None and after is not None
    assert after == pytest.approx(int(STALL * (0.020 / 0.0009 + 16)), abs=1)
    assert after < before


def test_when_a_wave_ends_the_next_fills_the_batch_within_the_usual_steps_time() -> None:
    """Most tokens come from steps of about 16 decoding sequences; with only 2 left decoding, a step
    may carry the prompt tokens that fill the rest of such a step's time, and more."""
    budget = PromptBudget()
    feed(budget, 0.010, 0.0003, MIXED_SIZES)
    few = budget.cap(decoding=2, prefilling=14)
    usual = budget.cap(decoding=16, prefilling=1)
    assert few is not None and usual is not None and few > usual + 14
    usual_step = 0.010 + 0.0003 * 16
    assert 0.010 + 0.0003 * (2 + few) <= (1 + MAX_STALL) * usual_step + 1e-12


def test_each_waiting_prompt_keeps_moving_when_several_arrive_together() -> None:
    budget = PromptBudget()
    feed(budget, 0.010, 0.0003, MIXED_SIZES)
    alone = budget.cap(decoding=16, prefilling=1)
    assert alone is not None and alone > PROMPT_TOKENS_PER_WAITING  # one arrival: the stall rule decides
    group = budget.cap(decoding=16, prefilling=4)
    assert group == PROMPT_TOKENS_PER_WAITING * 4 > alone  # four: each still advances every step
    crowd = budget.cap(decoding=16, prefilling=40)
    assert crowd is not None and crowd < PROMPT_TOKENS_PER_WAITING * 40  # within the stretched bound
    assert 0.010 + 0.0003 * (16 + crowd) <= (1 + MAX_STALL) * (0.010 + 0.0003 * 16) + 1e-12


@given(
    decoding=st.integers(1, 64),
    prefilling=st.integers(0, 64),
    usual=st.integers(1, 64),
    fixed=st.floats(0.0, 0.05),
    per_token=st.floats(1e-5, 5e-3),
)
def test_no_step_takes_longer_than_the_bound_allows(decoding, prefilling, usual, fixed, per_token) -> None:
    """Whatever the mix, a capped step takes at most 1 + MAX_STALL usual decode steps (or the time
    the minimum chunk needs), which bounds inter-token latency p99 within 2x its p50."""
    budget = PromptBudget()
    feed(budget, fixed, per_token, MIXED_SIZES, decoding=usual)
    cap = budget.cap(decoding, prefilling)
    cost = budget.step_cost()
    if cost is None:
        assert cap is None
        return
    assert cap is not None
    usual_tokens = max(budget.usual_decoding, decoding)
    bound = max(
        (1 + MAX_STALL) * (fixed + per_token * usual_tokens),
        fixed + per_token * (decoding + MIN_PROMPT_TOKENS),
    )
    assert fixed + per_token * (decoding + cap) <= bound * (1 + 1e-9) + 1e-12
