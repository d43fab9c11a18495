"""The paged step's inputs as host lists: KV slots and block tables of the chunks, the rows whose
logits a step keeps and how they map back to chunks, and the prefix all decode sequences share.

Every input is laid out in Python lists here and becomes a tensor in one call (engines/paged/staging.py):
a step's inputs are a few hundred small integers, for which each torch operator (a few microseconds)
costs more than the arithmetic, and a step of 16 sequences built them per sequence in about 1.3 ms."""

from __future__ import annotations

from collections.abc import Sequence

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


def slots(chunks: Sequence[SequenceChunk], block_size: int) -> list[int]:
    """The KV cache slot (block * block_size + offset) of every position of the chunks, in step order."""
    return [
        chunk.block_table[position // block_size] * block_size + position % block_size
        for chunk in chunks
        for position in range(chunk.start, chunk.end)
    ]


def used_blocks(chunk: SequenceChunk, block_size: int) -> Sequence[int]:
    """The blocks of the chunk's table that hold its positions so far, its own included."""
    return chunk.block_table[: -(-chunk.end // block_size)]


def per_token_tables(
    chunks: Sequence[SequenceChunk], tables: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[int]] | None:
    """Every token's block table (its chunk's `used_blocks` in `tables`, padded with block 0) and the
    positions it attends (its own position + 1), in step order; None when a chunk is longer than
    PER_TOKEN_MAX_CHUNK."""
    if any(len(chunk.token_ids) > PER_TOKEN_MAX_CHUNK for chunk in chunks):
        return None
    rows = padded(tables)
    per_token = [row for chunk, row in zip(chunks, rows, strict=True) for _ in chunk.token_ids]
    return per_token, [position + 1 for chunk in chunks for position in range(chunk.start, chunk.end)]


def padded(tables: Sequence[Sequence[int]], fill: int = 0, width: int | None = None) -> list[list[int]]:
    """The tables padded with `fill` to `width` (default: the longest one's)."""
    width = max((len(table) for table in tables), default=0) if width is None else width
    return [[*table, *[fill] * (width - len(table))] for table in tables]


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
