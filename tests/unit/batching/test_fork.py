"""A beam branching off another: `PagedPlanner.fork` shares full blocks and copies the partly filled one."""

from __future__ import annotations

import pytest

from tgis.batching.blocks import BlockPool
from tgis.batching.paged import PagedPlanner, PagedSequence


def decoding(planner: PagedPlanner, seq_id: int, prompt: list[int]) -> None:
    planner.add(PagedSequence(seq_id, list(prompt), len(prompt), 16))
    planner.computed(planner.plan())  # the whole prompt in one step: every position computed


def test_a_fork_shares_full_blocks_and_copies_only_the_partial_one() -> None:
    pool = BlockPool(32, 4)
    planner = PagedPlanner(pool, max_step_tokens=64)
    decoding(planner, 1, list(range(10)))  # positions 0-9: two full blocks and half of a third
    parent = planner.sequence(1)
    copy = planner.fork(1, -1)
    child = planner.sequence(-1)
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    assert copy == (parent.blocks[2], child.blocks[2])
    assert [pool.refs(b) for b in parent.blocks] == [2, 2, 1]
    assert child.token_ids == parent.token_ids and child.computed == parent.computed == 10
    assert planner.decode_order == [1, -1]
    assert pool.usage().used == 4  # three blocks of prompt, one copy: not twice the prompt


def test_a_fork_on_a_block_boundary_copies_nothing_and_finishing_returns_every_block() -> None:
    pool = BlockPool(32, 4)
    planner = PagedPlanner(pool, max_step_tokens=64)
    decoding(planner, 1, list(range(8)))
    assert planner.fork(1, -1) is None
    planner.append_tokens(1, [50], 0)
    planner.append_tokens(-1, [60], 0)
    planner.computed(planner.plan())  # each writes position 8 into a block of its own
    assert planner.sequence(1).blocks[2] != planner.sequence(-1).blocks[2]
    planner.finish(1)
    assert pool.usage().used == 3
    planner.finish(-1)
    assert pool.usage().used == 0


def test_only_a_sequence_with_every_position_computed_forks() -> None:
    planner = PagedPlanner(BlockPool(32, 4), max_step_tokens=64)
    planner.add(PagedSequence(1, [1, 2, 3], 3, 4))
    with pytest.raises(ValueError, match="not computed"):
        planner.fork(1, -1)
    planner.computed(planner.plan())
    planner.fork(1, -1)
    with pytest.raises(ValueError, match="already running"):
        planner.fork(1, -1)
