"""Decode graphs' planning side (engines/paged/graphs.py): buckets, workspace tiers, eligibility, the
padded inputs a step stages into a graph's buffer, and what a graph runs (the engine's graph forward,
run eagerly here with the kernel's torch stand-in) against the eager step, padding rows and batch sizes
between buckets included. Capture and replay need CUDA (tests/engines/test_cuda_step.py)."""

from __future__ import annotations

import pytest
import torch

from engines.base import EngineSpec, LoraAdapter
from engines.paged import graphs, paths, varlen
from engines.paged.engine import build
from engines.paged.staging import Staging
from engines.paged.step_context import AttentionPath
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

BLOCK = 4
CPU = torch.device("cpu")


def test_a_step_takes_the_smallest_bucket_that_holds_it() -> None:
    assert graphs.bucket_for(1, graphs.BUCKETS) == 1
    assert graphs.bucket_for(3, graphs.BUCKETS) == 4
    assert graphs.bucket_for(17, graphs.BUCKETS) == 24
    assert graphs.bucket_for(129, graphs.BUCKETS) is None


def test_the_largest_batch_is_a_bucket_of_its_own() -> None:
    """MAX_BATCH_SIZE=12 (the default): batches of 9 to 12 replay the graph of 12, not none."""
    assert graphs.buckets_up_to(12) == (1, 2, 4, 8, 12)
    assert graphs.bucket_for(9, graphs.buckets_up_to(12)) == 12
    assert graphs.buckets_up_to(16) == (1, 2, 4, 8, 16)
    assert graphs.buckets_up_to(200)[-2:] == (128, 200)


def test_workspace_tiers_double_up_to_what_the_bucket_holds() -> None:
    assert graphs.tiers(1, max_positions=2048, capacity=10**6) == (256, 512, 1024, 2048)
    assert graphs.tiers(4, max_positions=2048, capacity=10**6) == (1024, 2048, 4096, 8192)
    assert graphs.tiers(4, max_positions=2048, capacity=3000) == (1024, 2048, 3000)
    assert graphs.tiers(2, max_positions=100, capacity=10**6) == (200,)


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


BATCH = StepBatch(
    decode=(
        SequenceChunk((11,), 9, (3, 7, 2), sample=True),  # position 9: third block (2), offset 1
        SequenceChunk((12,), 0, (5,), sample=True),
    )
)


@pytest.mark.parametrize("gathered", [False, True])
def test_padding_rows_write_and_read_only_the_scratch_block(gathered) -> None:
    fields = graphs.DecodeInputs.fields(BATCH, 4, BLOCK, width=4, scratch_block=30, gathered=gathered)
    inputs = graphs.DecodeInputs.upload(fields, Staging(CPU))
    assert inputs.token_ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [9, 0, 0, 0]
    assert inputs.slots.tolist() == [2 * BLOCK + 1, 5 * BLOCK, 30 * BLOCK, 30 * BLOCK]
    assert inputs.key_lengths.tolist() == ([0, 10, 11, 12, 13] if gathered else [10, 1, 1, 1])
    assert inputs.block_tables.tolist() == [[3, 7, 2, 30], [5, 30, 30, 30], [30] * 4, [30] * 4]
    assert inputs.key_lengths.dtype == inputs.block_tables.dtype == torch.int32


def test_inputs_are_staged_into_a_graphs_buffer_in_one_copy() -> None:
    staging = Staging(CPU)
    fields = graphs.DecodeInputs.fields(StepBatch(), 2, BLOCK, 3, scratch_block=9, gathered=False)
    buffer = torch.zeros(graphs._bytes(fields), dtype=torch.uint8)
    static = graphs.DecodeInputs.upload(fields, staging, buffer)
    batch = StepBatch(decode=(SequenceChunk((11,), 2, (1,), sample=True),))
    before = staging.uploads
    graphs.DecodeInputs.upload(
        graphs.DecodeInputs.fields(batch, 2, BLOCK, 3, 9, gathered=False), staging, buffer
    )
    assert staging.uploads == before + 1
    assert static.token_ids.tolist() == [11, 0] and static.slots.tolist() == [1 * BLOCK + 2, 9 * BLOCK]


def test_a_step_replays_the_smallest_tier_that_holds_its_positions() -> None:
    tiers_of = lambda bucket: graphs.tiers(bucket, max_positions=1024, capacity=10**6)  # noqa: E731
    planned = graphs.DecodeGraphs(BLOCK, 256, 400, graphs.buckets_up_to(3), tiers_of)
    assert planned.shapes()[0] == (3, 3072) and planned.shapes()[-1] == (1, 256)
    assert planned.shape_for(BATCH) == (2, 512)  # 10 + 1 positions
    long = StepBatch(decode=(SequenceChunk((1,), 400, tuple(range(101)), sample=True),) * 2)
    assert planned.shape_for(long) == (2, 1024)  # 802 positions
    assert planned.shape_for(StepBatch(decode=BATCH.decode * 2)) is None  # 4 sequences: past the buckets
    paged = graphs.DecodeGraphs(BLOCK, 256, 400, graphs.buckets_up_to(3))
    assert paged.shapes() == [(3, None), (2, None), (1, None)] and paged.shape_for(BATCH) == (2, None)


def decode_steps(engine) -> list[StepBatch]:
    """Prompts of 5 sequences (one longer than a block), then decode steps of 1, 3 (between buckets: 2
    padding rows in the bucket of 4) and 5 sequences (the largest batch, its own bucket)."""
    tables = [tuple(range(4 * i, 4 * i + 4)) for i in range(5)]
    lengths = [5, 9, 2, 12, 7]
    prompts = tuple(
        SequenceChunk(tuple(range(10 + i, 10 + i + n)), 0, table, sample=True)
        for i, (n, table) in enumerate(zip(lengths, tables, strict=True))
    )
    engine.step(StepBatch(prefill=prompts))
    decode = [
        SequenceChunk((3 + i,), n, table, sample=True)
        for i, (n, table) in enumerate(zip(lengths, tables, strict=True))
    ]
    return [StepBatch(decode=tuple(decode[:count])) for count in (1, 3, 5)]


@pytest.mark.parametrize("path", [AttentionPath.VARLEN_PAGED, AttentionPath.VARLEN_GATHERED])
def test_what_a_graph_runs_gives_the_eager_steps_logits(path) -> None:
    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, CPU, torch.float32, paged=True)
    engine = build(model, spec, BLOCK)
    engine.use_attention(paths.AttentionChoice(path, BLOCK, varlen.reference_varlen))
    engine.allocate(24, BLOCK)
    planned = engine.prepare_decode_graphs(max_positions=32, max_batch=5)
    assert planned.buckets == (1, 2, 4, 5)
    for batch in decode_steps(engine):
        eager = engine.step(batch).logits.clone()
        shape = planned.shape_for(batch)
        assert shape is not None
        fields = graphs.DecodeInputs.fields(batch, shape[0], BLOCK, planned.width, planned.scratch_block,
                                            gathered=path is AttentionPath.VARLEN_GATHERED)  # fmt: skip
        inputs = graphs.DecodeInputs.upload(fields, Staging(CPU))
        graphed = engine.graph_forward(inputs, shape[1])[: len(batch.decode)]
        assert torch.allclose(graphed, eager, atol=1e-4), (path, len(batch.decode))
