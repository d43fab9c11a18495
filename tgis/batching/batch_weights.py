"""Batch weights from memory coefficients: padded and unpadded models, startup fit check (SPEC §6.4)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from tgis.batching.admission import BatchWeights, SequenceShape, exceeds


@dataclass(frozen=True)
class MemoryCoefficients:
    """Memory per token (SPEC §6.5): prefill linear `a`, prefill quadratic `b` and `c`, next-token
    `d` (per input token) and `e` (per output token). All non-negative."""

    a: float
    b: float
    c: float
    d: float
    e: float


def _by_output_descending(batch: Sequence[SequenceShape], candidate: SequenceShape) -> list[tuple[int, int]]:
    """The (remaining out, current in) tuples of batch + candidate, longest remaining output first."""
    tuples = [(s.remaining_new_tokens, s.input_length) for s in (*batch, candidate)]
    return sorted(tuples, reverse=True)


@dataclass(frozen=True)
class PaddedWeights:
    """Rectangular batches (HF engines): every row is as long as the longest one."""

    coefficients: MemoryCoefficients
    max_weight: float
    max_prefill_padding: float

    @property
    def next_token_coefficient(self) -> float:
        return max(self.coefficients.d, self.coefficients.e)

    def worst(self, batch: Sequence[SequenceShape]) -> float:
        if not batch:
            return 0.0
        max_in = max(s.input_length for s in batch)
        max_out = max(s.remaining_new_tokens for s in batch)
        return (max_in + max_out) * len(batch) * self.next_token_coefficient

    def initial(self, batch: Sequence[SequenceShape]) -> float:
        if not batch:
            return 0.0
        return max(s.input_length for s in batch) * len(batch) * self.next_token_coefficient

    def prefill(self, group: Sequence[SequenceShape]) -> float:
        if not group:
            return 0.0
        max_in = max(s.input_length for s in group)
        tokens = len(group) * max_in
        c = self.coefficients
        return max(tokens * c.a, tokens * c.b + tokens * max_in * c.c)

    def padding(self, group: Sequence[SequenceShape]) -> float:
        if not group:
            return 0.0
        positions = len(group) * max(s.input_length for s in group)
        if positions == 0:
            return 0.0
        return (positions - sum(s.input_length for s in group)) / positions

    def granular_fits(self, batch: Sequence[SequenceShape], candidate: SequenceShape) -> bool:
        """Walk the sequences by remaining output, longest first: when the i-th of them finishes,
        i + 1 rows of the longest input so far M are (M + out) long."""
        coefficient = self.next_token_coefficient
        longest_in = 0
        for i, (out, tokens_in) in enumerate(_by_output_descending(batch, candidate)):
            longest_in = max(longest_in, tokens_in)
            if out <= candidate.remaining_new_tokens and exceeds(
                (longest_in + out) * (i + 1) * coefficient, self.max_weight
            ):
                return False
        return True


@dataclass(frozen=True)
class UnpaddedWeights:
    """Flash / paged batches: memory follows the tokens actually held (g_p = a, g_nt = e)."""

    coefficients: MemoryCoefficients
    max_weight: float
    max_prefill_padding: float

    def worst(self, batch: Sequence[SequenceShape]) -> float:
        tokens = sum(s.input_length + s.remaining_new_tokens for s in batch)
        return tokens * self.coefficients.e

    def initial(self, batch: Sequence[SequenceShape]) -> float:
        return sum(s.input_length for s in batch) * self.coefficients.e

    def prefill(self, group: Sequence[SequenceShape]) -> float:
        return sum(s.input_length for s in group) * self.coefficients.a

    def padding(self, group: Sequence[SequenceShape]) -> float:
        return 0.0

    def granular_fits(self, batch: Sequence[SequenceShape], candidate: SequenceShape) -> bool:
        """Walk the sequences by remaining output, longest first: when the i-th of them finishes,
        the i + 1 still running hold their inputs I plus `out` tokens each."""
        inputs = 0
        for i, (out, tokens_in) in enumerate(_by_output_descending(batch, candidate)):
            inputs += tokens_in
            if out <= candidate.remaining_new_tokens and exceeds(
                (inputs + (i + 1) * out) * self.coefficients.e, self.max_weight
            ):
                return False
        return True


def weights_for(
    coefficients: MemoryCoefficients, max_weight: float, max_prefill_padding: float, *, padded: bool
) -> PaddedWeights | UnpaddedWeights:
    kind = PaddedWeights if padded else UnpaddedWeights
    return kind(coefficients, max_weight, max_prefill_padding)


def _admits(weights: BatchWeights, batch_size: int, input_length: int) -> bool:
    """Would an empty batch take `batch_size` requests of `input_length` tokens and one new token?"""
    group = [SequenceShape(input_length, 1)] * batch_size
    limit = weights.max_weight
    return not exceeds(weights.prefill(group), limit) and not exceeds(weights.worst(group), limit)


def longest_admitted_input(weights: BatchWeights, batch_size: int, max_input_length: int) -> int:
    """The longest input (≤ max_input_length) that `batch_size` equal requests may have; 0 if none.
    Weights grow with the input length, so a binary search finds it."""
    low, high = 0, max_input_length
    while low < high:
        middle = (low + high + 1) // 2
        if _admits(weights, batch_size, middle):
            low = middle
        else:
            high = middle - 1
    return low


def longest_request(weights: BatchWeights, max_sequence_length: int) -> int:
    """The longest single request (input + output tokens, ≤ max_sequence_length) the model admits."""
    low, high = 0, max_sequence_length
    while low < high:
        middle = (low + high + 1) // 2
        one = [SequenceShape(middle, 0)]
        limit = weights.max_weight
        if exceeds(weights.prefill(one), limit) or exceeds(weights.worst(one), limit):
            high = middle - 1
        else:
            low = middle
    return low


def warmup_shapes(
    weights: BatchWeights, max_sequence_length: int, max_batch_size: int, count: int = 10, seed: int = 0
) -> list[tuple[int, int]]:
    """About `count` (batch size, input length) prefill shapes that the weights admit into an empty
    batch, sorted: the longest input for one request and the largest batch at its longest input,
    then seeded random picks in between (used to warm up a compiled forward)."""
    max_input = max_sequence_length - 1
    longest = {
        size: length
        for size in range(1, max_batch_size + 1)
        if (length := longest_admitted_input(weights, size, max_input)) >= 1
    }
    if not longest or count <= 0:
        return []
    # Weights grow with the batch size, so the admitted sizes are 1..largest.
    largest = max(longest)
    shapes = {(1, longest[1]), (largest, longest[largest])}
    rng = random.Random(seed)
    attempts = 0
    while len(shapes) < count and attempts < 100 * count:
        attempts += 1
        size = rng.randint(1, largest)
        shapes.add((size, rng.randint(1, longest[size])))
    return sorted(shapes)
