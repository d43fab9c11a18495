"""Decode graphs' planning side (engines/paged/graphs.py): buckets, eligibility and the padded inputs a
step copies into a graph's buffers. Capture and replay need CUDA (the GPU tests)."""

from __future__ import annotations

import torch

from engines.base import LoraAdapter
from engines.paged import graphs
from engines.step import SequenceChunk, StepBatch

BLOCK = 4


def test_a_step_takes_the_smallest_bucket_that_holds_it() -> None:
    assert graphs.bucket_for(1, graphs.BUCKETS) == 1
    assert graphs.bucket_for(3, graphs.BUCKETS) == 4
    assert graphs.bucket_for(17, graphs.BUCKETS) == 24
    assert graphs.bucket_for(129, graphs.BUCKETS) is None


def test_only_plain_decode_steps_replay_a_graph() -> None:
    decode = SequenceChunk((5,), 9, (0, 1, 2), sample=True)
    assert graphs.eligible(StepBatch(decode=(decode,)))
    assert not graphs.eligible(StepBatch(decode=(decode,), prefill=(SequenceChunk((1, 2), 0, (3,)),)))
    assert not graphs.eligible(StepBatch(decode=(decode,), hidden=True))
    details = SequenceChunk((5,), 9, (0, 1, 2), sample=True, all_logits=True)
    assert not graphs.eligible(StepBatch(decode=(details,)))
    lora = SequenceChunk((5,), 9, (0, 1, 2), sample=True, lora=LoraAdapter("a", None))  # type: ignore[arg-type]
    assert not graphs.eligible(StepBatch(decode=(lora,)))
    assert not graphs.eligible(StepBatch())


def test_padding_rows_write_and_read_only_the_scratch_block() -> None:
    batch = StepBatch(
        decode=(
            SequenceChunk((11,), 9, (3, 7, 2), sample=True),  # position 9: third block (2), offset 1
            SequenceChunk((12,), 0, (5,), sample=True),
        )
    )
    inputs = graphs.DecodeInputs.of(batch, bucket=4, block_size=BLOCK, width=4, scratch_block=30)
    assert inputs.token_ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [9, 0, 0, 0]
    assert inputs.slots.tolist() == [2 * BLOCK + 1, 5 * BLOCK, 30 * BLOCK, 30 * BLOCK]
    assert inputs.seq_lens.tolist() == [10, 1, 1, 1]
    assert inputs.block_tables.tolist() == [[3, 7, 2, 30], [5, 30, 30, 30], [30] * 4, [30] * 4]
    assert inputs.seq_lens.dtype == inputs.block_tables.dtype == torch.int32


def test_inputs_copy_into_a_graphs_static_buffers() -> None:
    batch = StepBatch(decode=(SequenceChunk((11,), 2, (1,), sample=True),))
    static = graphs.DecodeInputs.of(StepBatch(), 2, BLOCK, 3, scratch_block=9)
    graphs.DecodeInputs.of(batch, 2, BLOCK, 3, scratch_block=9).copy_into(static)
    assert static.token_ids.tolist() == [11, 0] and static.slots.tolist() == [1 * BLOCK + 2, 9 * BLOCK]
