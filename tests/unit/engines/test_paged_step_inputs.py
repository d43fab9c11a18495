"""How the paged engine lays a step out for attention: the prefix decode sequences share."""

from __future__ import annotations

from engines.paged import step_inputs
from engines.step import SequenceChunk


def _decode(start: int, table: tuple[int, ...]) -> SequenceChunk:
    return SequenceChunk((1,), start, table, sample=True)


def test_shared_prefix_blocks_are_the_common_leading_blocks_before_every_new_token(monkeypatch):
    monkeypatch.setattr(step_inputs, "SHARED_PREFIX_MIN_WORK", 0)
    same = (7, 8, 9)
    batch = [_decode(50, (*same, 1, 2)), _decode(40, (*same, 3)), _decode(45, (*same, 4, 5))]
    assert step_inputs.shared_prefix_blocks(batch, 16) == 2  # position 40's own block is block 2
    batch.append(_decode(60, (7, 8, 6, 10)))
    assert step_inputs.shared_prefix_blocks(batch, 16) == 2
    batch.append(_decode(60, (7, 11, 9, 12)))
    assert step_inputs.shared_prefix_blocks(batch, 16) == 1
    assert step_inputs.shared_prefix_blocks([_decode(50, (*same, 1))], 16) == 0  # one sequence: no split


def test_a_small_shared_prefix_is_not_split_off(monkeypatch):
    batch = [_decode(40, (7, 8, 9)), _decode(40, (7, 8, 10))]
    monkeypatch.setattr(step_inputs, "SHARED_PREFIX_MIN_WORK", 2 * 32 + 1)
    assert step_inputs.shared_prefix_blocks(batch, 16) == 0
    monkeypatch.setattr(step_inputs, "SHARED_PREFIX_MIN_WORK", 2 * 32)
    assert step_inputs.shared_prefix_blocks(batch, 16) == 2
