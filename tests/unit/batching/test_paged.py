"""The paged step planner and block-counted admission, driven with fabricated model outputs."""

from __future__ import annotations

import pytest

from tgis.batching.admission import Admission, Candidate, SequenceShape
from tgis.batching.blocks import BlockPool
from tgis.batching.paged import BlockWeights, PagedPlanner, PagedSequence


def sequence(seq_id: int, prompt: list[int], max_new: int = 8, key: str | None = None) -> PagedSequence:
    return PagedSequence(seq_id, list(prompt), len(prompt), max_new, cache_key=key)


def run(planner: PagedPlanner, sampled: dict[int, int] | None = None, prompt_cap: int | None = None):
    """Plan a step, pretend the model ran it, and feed each sampling sequence a token."""
    plan = planner.plan(prompt_cap)
    planner.computed(plan)
    for chunk in plan.sampling:
        planner.append_tokens(chunk.seq_id, [(sampled or {}).get(chunk.seq_id, 7)], 0)
    return plan


def test_a_long_prompt_is_split_across_steps_and_samples_only_at_its_end():
    planner = PagedPlanner(BlockPool(16, 4), max_step_tokens=6)
    planner.add(sequence(1, list(range(100, 115))))  # 15 prompt tokens
    plans = [run(planner) for _ in range(3)]
    assert [(c.start, c.length, c.samples) for p in plans for c in p.chunks] == [
        (0, 6, False),
        (6, 6, False),
        (12, 3, True),
    ]
    assert planner.decode_order == [1]
    assert len(plans[-1].chunks[0].block_table) == 4  # 15 positions in blocks of 4


def test_decoding_sequences_come_first_and_prompts_fill_the_remaining_budget():
    planner = PagedPlanner(BlockPool(32, 4), max_step_tokens=5)
    planner.add(sequence(1, [1, 2]))
    run(planner)  # prompt of 1 done: it decodes from now on
    planner.add(sequence(2, list(range(10, 20))))
    planner.add(sequence(3, [5, 6]))
    plan = run(planner)
    assert [(c.seq_id, c.start, c.length) for c in plan.chunks] == [(1, 2, 1), (2, 0, 4)]
    plan = run(planner)
    assert [(c.seq_id, c.start, c.length) for c in plan.chunks] == [(1, 3, 1), (2, 4, 4)]
    plan = run(planner)
    assert [(c.seq_id, c.length, c.samples) for c in plan.chunks] == [
        (1, 1, True),
        (2, 2, True),
        (3, 2, True),
    ]
    assert planner.decode_order == [1, 2, 3]


def test_the_prompt_cap_limits_prompt_chunks_beside_decodes_but_never_stops_them():
    planner = PagedPlanner(BlockPool(32, 4), max_step_tokens=64)
    planner.add(sequence(1, [1, 2]))
    run(planner)
    planner.add(sequence(2, list(range(10, 30))))  # 20 prompt tokens
    plan = run(planner, prompt_cap=8)
    assert [(c.seq_id, c.start, c.length) for c in plan.chunks] == [(1, 2, 1), (2, 0, 8)]
    plan = run(planner, prompt_cap=100)  # a cap above the budget leaves the budget in charge
    assert [(c.seq_id, c.start, c.length) for c in plan.chunks] == [(1, 3, 1), (2, 8, 12)]


def test_every_block_is_free_again_after_sequences_finish():
    pool = BlockPool(8, 4)
    planner = PagedPlanner(pool, max_step_tokens=64)
    planner.add(sequence(1, list(range(9))))
    planner.add(sequence(2, list(range(3))))
    for _ in range(5):
        run(planner)
    assert pool.num_free < 8
    planner.finish(1)
    planner.finish(2)
    planner.finish(2)  # finishing twice (a cancel racing a stop) is harmless
    assert pool.num_free == 8
    assert len(planner) == 0


def test_a_repeated_prompt_reuses_the_cached_blocks_but_computes_its_last_token():
    pool = BlockPool(16, 4)
    planner = PagedPlanner(pool, max_step_tokens=64)
    prompt = list(range(50, 62))  # 12 tokens: three full blocks
    planner.add(sequence(1, prompt))
    run(planner)
    planner.finish(1)
    lookup = planner.add(sequence(2, prompt))
    # Only the first two blocks: the block holding the last prompt token is recomputed.
    assert (lookup.queried_tokens, lookup.hit_tokens) == (12, 8)
    plan = run(planner)
    assert [(c.start, c.length) for c in plan.chunks] == [(8, 4)]


def test_a_shared_prefix_is_held_once_while_both_sequences_run():
    pool = BlockPool(16, 4)
    planner = PagedPlanner(pool, max_step_tokens=64)
    system = list(range(200, 208))
    planner.add(sequence(1, [*system, 1, 2, 3]))
    run(planner)
    lookup = planner.add(sequence(2, [*system, 9]))
    assert lookup.hit_tokens == 8
    first, second = planner.sequence(1).blocks, planner.sequence(2).blocks
    assert first[:2] == second[:2]
    assert pool.refs(first[0]) == 2
    planner.finish(1)
    assert pool.refs(first[0]) == 1  # still held by the other sequence


def test_cached_blocks_of_another_adapter_are_not_reused():
    planner = PagedPlanner(BlockPool(16, 4), max_step_tokens=64)
    prompt = list(range(9))
    planner.add(sequence(1, prompt, key="lora-a"))
    run(planner)
    assert planner.add(sequence(2, prompt, key="lora-b")).hit_tokens == 0
    assert planner.add(sequence(3, prompt, key="lora-a")).hit_tokens == 8


def test_a_sequence_that_must_not_hit_the_cache_computes_everything():
    planner = PagedPlanner(BlockPool(16, 4), max_step_tokens=64)
    planner.add(sequence(1, list(range(9))))
    run(planner)
    assert planner.add(sequence(2, list(range(9))), use_cached=False).hit_tokens == 0


def test_generated_tokens_fill_blocks_that_later_prompts_can_reuse():
    pool = BlockPool(16, 4)
    planner = PagedPlanner(pool, max_step_tokens=64)
    planner.add(sequence(1, [1, 2, 3]))
    for token in (4, 5, 6):
        run(planner, {1: token})
    # positions 0..3 are computed: [1, 2, 3, 4] is a full block
    assert planner.add(sequence(2, [1, 2, 3, 4, 5])).hit_tokens == 4


def test_block_weights_count_whole_blocks_per_sequence():
    weights = BlockWeights(block_size=4, max_weight=10)
    batch = [SequenceShape(5, 3), SequenceShape(1, 0)]
    assert weights.worst(batch) == 2 + 1
    assert weights.initial(batch) == 2 + 1
    assert weights.prefill(batch) == 0 and weights.padding(batch) == 0


def test_granular_check_admits_a_short_request_beside_long_ones_only_when_blocks_suffice():
    weights = BlockWeights(block_size=4, max_weight=6)
    running = [SequenceShape(8, 8)]  # up to 4 blocks
    assert weights.granular_fits(running, SequenceShape(4, 4))  # 3 + 2 blocks at its end
    assert not weights.granular_fits(running, SequenceShape(8, 8))


def test_admission_waits_when_the_pool_cannot_hold_a_request_and_admits_it_once_blocks_free():
    block_size, blocks = 4, 6
    scheduler = Admission(max_batch_size=8, max_waiting_tokens=1, weights=BlockWeights(block_size, blocks))
    running = [SequenceShape(12, 8)]  # 5 blocks reserved
    waiting = [Candidate(SequenceShape(8, 8), queued_at=0.0)]
    assert scheduler.select(waiting, running, 1).indices == []
    assert scheduler.select(waiting, [], 1).indices == [0]


@pytest.mark.parametrize("budget", [1, 3, 64])
def test_any_budget_makes_progress_on_every_prompt(budget):
    planner = PagedPlanner(BlockPool(64, 4), max_step_tokens=budget)
    for seq_id in range(3):
        planner.add(sequence(seq_id, list(range(7))))
    for _ in range(40):
        run(planner)
    assert planner.decode_order == [0, 1, 2]
