"""A step's tensors for the attention path that serves it: token ids, positions, KV slots, the rows whose
logits are kept, and what attention reads, laid out as host lists and sent to the device in one staged
copy (engines/paged/staging.py). Each path builds only what it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from engines.paged import cpu_kernel, ragged, step_inputs
from engines.paged.forward import FusedLayers, StepContext
from engines.paged.staging import Field, Staging
from engines.paged.varlen import Kernel
from engines.step import SequenceChunk, StepBatch


class AttentionPath(StrEnum):
    """How a step's layers attend (the `tgi_attention_path` metric's `path`)."""

    VARLEN_PAGED = "varlen_paged"  # CUDA: one varlen call per layer, keys read from the blocks in place
    VARLEN_GATHERED = "varlen_gathered"  # CUDA: one varlen call per layer over the step's gathered keys
    CPU_KERNEL = "cpu_kernel"  # CPU: the C++ decode kernels (cpu_decode.cpp) read the blocks in place
    PER_SEQUENCE = "per_sequence"  # torch alone: decode tokens over padded gathers, prompt chunks one by one

    @property
    def varlen(self) -> bool:
        return self in (AttentionPath.VARLEN_PAGED, AttentionPath.VARLEN_GATHERED)


@dataclass
class StepBuilder:
    """What a step's tensors are built from: the engine's pool, its path and its staging buffer."""

    path: AttentionPath
    block_size: int
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    staging: Staging
    kernel: Kernel | None = None  # the varlen paths' kernel
    workspace: Callable[[int], ragged.Workspace] | None = None  # gathered: one of at least n positions


@dataclass(frozen=True)
class StepTensors:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    keep: torch.Tensor  # the step positions whose logits are kept
    rows: list[range]  # each chunk's rows among the kept ones
    context: StepContext


def build(batch: StepBatch, builder: StepBuilder) -> StepTensors:
    """The step's tensors, uploaded together; nothing here reads a device tensor back."""
    chunks, size = batch.chunks, builder.block_size
    keep, rows = step_inputs.logit_rows(chunks)
    common = [
        Field([t for chunk in chunks for t in chunk.token_ids]),
        Field([p for chunk in chunks for p in range(chunk.start, chunk.end)]),
        Field(step_inputs.slots(chunks, size)),
        Field(keep),
    ]
    tables = [step_inputs.used_blocks(chunk, size) for chunk in chunks]  # decode chunks first
    build_path = _varlen if builder.path.varlen else _per_sequence
    (ids, positions, kept), context = build_path(batch, tables, builder, common)
    return StepTensors(ids, positions, kept, rows, context)


Common = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # token ids, positions, kept rows


def _varlen(
    batch: StepBatch, tables: Sequence[Sequence[int]], builder: StepBuilder, common: list[Field]
) -> tuple[Common, StepContext]:
    chunks = batch.chunks
    lengths = [len(chunk.token_ids) for chunk in chunks]
    ends = [chunk.end for chunk in chunks]
    paged = builder.path is AttentionPath.VARLEN_PAGED
    key_offsets = ends if paged else _cumulative(ends)  # seqused_k, or cu_seq_k
    uploaded = builder.staging.upload(
        [
            *common,
            Field(_cumulative(lengths), torch.int32),
            Field(key_offsets, torch.int32),
            Field(step_inputs.padded(tables, width=max(1, max(map(len, tables), default=1))), torch.int32),
        ]
    )
    ids, positions, slots, kept, cu_seq_q, keys, table = uploaded
    assert builder.kernel is not None
    layout = ragged.RaggedLayout(
        kernel=builder.kernel,
        cu_seq_q=cu_seq_q,
        block_table=table,
        max_q=max(lengths, default=0),
        max_k=max(ends, default=0),
        causal=max(lengths, default=0) > 1,
        seqused_k=keys if paged else None,
        cu_seq_k=None if paged else keys,
    )
    if not paged:
        assert builder.workspace is not None
        total = sum(ends)
        layout = _gathered(layout, total, builder.block_size, builder.workspace(total))
    context = StepContext(builder.key_caches, builder.value_caches, slots, len(batch.decode), ragged=layout)
    return (ids, positions, kept), context


def _gathered(
    layout: ragged.RaggedLayout, total: int, block_size: int, workspace: ragged.Workspace
) -> ragged.RaggedLayout:
    assert layout.cu_seq_k is not None
    gather = ragged.gather_slots(layout.cu_seq_k, layout.block_table, block_size, total, scratch_slot=0)
    return ragged.RaggedLayout(**{**vars(layout), "gather": gather, "workspace": workspace})


def _per_sequence(
    batch: StepBatch, tables: Sequence[Sequence[int]], builder: StepBuilder, common: list[Field]
) -> tuple[Common, StepContext]:
    """Decode tokens over their padded tables and prompt chunks one by one, or on CPU with the kernels
    built every token through them when all chunks are short."""
    num_decode, size = len(batch.decode), builder.block_size
    shared = step_inputs.shared_prefix_blocks(batch.decode, size)
    fused_kernel = None
    if builder.path is AttentionPath.CPU_KERNEL and not shared:
        fused_kernel = cpu_kernel.decode_layer_kernel()
    per_token = None
    if fused_kernel is not None:
        per_token = step_inputs.per_token_tables(batch.chunks, tables) if batch.prefill else None
        if per_token is None and not batch.prefill:  # one token a sequence: the decode tables are per token
            per_token = (step_inputs.padded(tables), [chunk.end for chunk in batch.decode])
    if per_token is not None:
        assert fused_kernel is not None
        ids, positions, slots, kept, token_tables, token_lengths = builder.staging.upload(
            [*common, *_table_fields(per_token[0]), Field(per_token[1])]
        )
        fused = FusedLayers(fused_kernel, _rows(token_tables, len(per_token[0])), token_lengths)
        context = StepContext(builder.key_caches, builder.value_caches, slots, num_decode, fused=fused)
        return (ids, positions, kept), context
    decode_rows, prefill_rows = (
        step_inputs.padded(tables[:num_decode]),
        step_inputs.padded(tables[num_decode:]),
    )
    ids, positions, slots, kept, decode_tables, decode_lengths, prefill_tables = builder.staging.upload(
        [
            *common,
            *_table_fields(decode_rows),
            Field([chunk.end for chunk in batch.decode]),
            *_table_fields(prefill_rows),
        ]
    )
    lengths = [len(chunk.token_ids) for chunk in batch.prefill]
    context = StepContext(
        builder.key_caches,
        builder.value_caches,
        slots,
        num_decode,
        decode_block_tables=_rows(decode_tables, len(decode_rows)),
        decode_lengths=decode_lengths,
        prefill_block_tables=_rows(prefill_tables, len(prefill_rows)),
        prefill_starts=tuple(_cumulative(lengths)[:-1]),
        prefill_lengths=tuple(lengths),
        prefill_contexts=tuple(chunk.start for chunk in batch.prefill),
        decode_shared_blocks=shared,
    )
    return (ids, positions, kept), context


def _table_fields(rows: list[list[int]]) -> list[Field]:
    """Padded tables as one field; flattened, as a table of no rows has no width to keep."""
    return [Field([block for row in rows for block in row])]


def _rows(flat: torch.Tensor, count: int) -> torch.Tensor:
    return flat.view(count, -1) if count else flat.view(0, 0)


def _cumulative(values: Sequence[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out


def prefix_chunks(chunks: Sequence[SequenceChunk]) -> bool:
    """Whether some chunk covers prompt-tuning prefix positions (its embeddings replace the ids')."""
    return any(
        chunk.prefix is not None and chunk.start < step_inputs.prefix_length(chunk) for chunk in chunks
    )
