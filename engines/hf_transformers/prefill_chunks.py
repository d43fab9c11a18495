"""How the padded engine cuts one prefill group into forward passes of rows of similar length."""

from __future__ import annotations

from collections.abc import Sequence

# A prefill group is split where padding would exceed this fraction of a forward pass's positions, or
# a pass would exceed this many positions (large passes cost more per position on CPU caches).
PREFILL_CHUNK_MAX_PADDING = 0.2
PREFILL_CHUNK_MAX_POSITIONS = 1024


def prefill_chunks(lengths: Sequence[int]) -> list[list[int]]:
    """Row indices per forward pass: all rows in their order when one pass pads little; otherwise rows
    sorted by length, cut where the next row would push padding or size past the limits."""

    def fits(chunk: Sequence[int]) -> bool:
        longest = max(lengths[i] for i in chunk)
        positions = longest * len(chunk)
        padding = (positions - sum(lengths[i] for i in chunk)) / positions
        return padding <= PREFILL_CHUNK_MAX_PADDING and positions <= PREFILL_CHUNK_MAX_POSITIONS

    everything = list(range(len(lengths)))
    if len(lengths) <= 1 or fits(everything):
        return [everything]
    chunks: list[list[int]] = []
    for i in sorted(everything, key=lambda i: lengths[i]):
        if chunks and fits([*chunks[-1], i]):
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks
