"""The paged step's inputs and outputs as tensors: KV slots and block tables of the chunks, the rows whose
logits a step keeps and how they map back to chunks, and the prefix all decode sequences share.

Every input is laid out in Python lists first and becomes a tensor in one call: a step's inputs are a
few hundred small integers, for which each torch operator (a few microseconds) costs more than the
arithmetic, and a step of 16 sequences built them per sequence in about 1.3 ms."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.step import SequenceChunk

# Decode sequences attend a prefix they share in one batched pass when it covers at least this many
# (sequence, position) pairs: below it, the extra small ops of the split cost more than they save.
SHARED_PREFIX_MIN_WORK = 2048
# On CPU a step whose prompt (or draft) chunks are all at most this long attends every token as a query
# of its own through the decode kernel (a draft being verified, a short prompt); a longer chunk gathers
# its context once for SDPA, which reads it once for all its queries.
PER_TOKEN_MAX_CHUNK = 16


def shared_prefix_blocks(decode: Sequence[SequenceChunk], block_size: int) -> int:
    """How many leading blocks all decode sequences share, each block wholly before every sequence's
    new token; 0 when that is too little work to split off (SHARED_PREFIX_MIN_WORK)."""
    if len(decode) < 2:
        return 0
    shared = min(chunk.start // block_size for chunk in decode)
    first = decode[0].block_table
    for chunk in decode[1:]:
        pairs = zip(chunk.block_table[:shared], first[:shared], strict=False)
        shared = next((i for i, (mine, theirs) in enumerate(pairs) if mine != theirs), shared)
    return shared if shared * block_size * len(decode) >= SHARED_PREFIX_MIN_WORK else 0


def prefix_length(chunk: SequenceChunk) -> int:
    prefix = chunk.prefix
    return 0 if prefix is None or prefix.decoder is None else int(prefix.decoder.shape[0])


def slots(chunks: Sequence[SequenceChunk], block_size: int, device: torch.device) -> torch.Tensor:
    """The KV cache slot (block * block_size + offset) of every position of the chunks, in step order."""
    return tensor(
        [
            chunk.block_table[position // block_size] * block_size + position % block_size
            for chunk in chunks
            for position in range(chunk.start, chunk.end)
        ],
        device,
    )


def used_blocks(chunk: SequenceChunk, block_size: int) -> Sequence[int]:
    """The blocks of the chunk's table that hold its positions so far, its own included."""
    return chunk.block_table[: -(-chunk.end // block_size)]


def per_token_tables(
    chunks: Sequence[SequenceChunk], tables: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every token's block table ([T, max_blocks], from its chunk's `used_blocks` in `tables`) and the
    positions it attends (its own position + 1, [T]), in step order; None when a chunk is longer than
    PER_TOKEN_MAX_CHUNK."""
    if any(len(chunk.token_ids) > PER_TOKEN_MAX_CHUNK for chunk in chunks):
        return None
    padded, width = _padded(tables)
    per_token = [row for chunk, row in zip(chunks, padded, strict=True) for _ in chunk.token_ids]
    lengths = tensor([position + 1 for chunk in chunks for position in range(chunk.start, chunk.end)], device)
    return _table_tensor(per_token, width, device), lengths


def block_tables(tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[len(tables), longest] block ids, each table padded with block 0."""
    return _table_tensor(*_padded(tables), device)


def _padded(tables: Sequence[Sequence[int]]) -> tuple[list[list[int]], int]:
    """The tables padded with block 0 to the longest one's width, and that width."""
    width = max((len(table) for table in tables), default=0)
    return [[*table, *[0] * (width - len(table))] for table in tables], width


def _table_tensor(rows: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).view(len(rows), width).to(device)


def tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device)


def logit_rows(chunks: Sequence[SequenceChunk]) -> tuple[list[int], list[range]]:
    """The step positions whose logits are kept, and for each chunk its rows among the kept ones
    (StepOutput.chunk_rows)."""
    keep: list[int] = []
    where: list[range] = []
    offset = 0
    for chunk in chunks:
        length = len(chunk.token_ids)
        if chunk.all_logits:
            wanted = range(offset, offset + length)
        elif chunk.sample:
            wanted = range(offset + length - 1, offset + length)
        else:
            wanted = range(0)
        where.append(range(len(keep), len(keep) + len(wanted)))
        keep.extend(wanted)
        offset += length
    return keep, where
