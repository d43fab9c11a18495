"""Admission: which queued requests join the running batch and when (SPEC §6.2–§6.3); pure, no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SequenceShape:
    """What batch accounting needs of one request.

    `input_length` counts every token the sequence holds now: input, prompt prefix and the tokens
    generated so far; `remaining_new_tokens` the tokens it may still generate.
    """

    input_length: int
    remaining_new_tokens: int


@dataclass(frozen=True)
class Candidate:
    shape: SequenceShape
    queued_at: float


class BatchWeights(Protocol):
    """The memory model admission works with (SPEC §6.4); weights are in the unit of `max_weight`.

    `max_weight` is Wmax (`math.inf`: no memory limit); `max_prefill_padding` the largest padding
    fraction a prefill may have.
    """

    @property
    def max_weight(self) -> float: ...

    @property
    def max_prefill_padding(self) -> float: ...

    def worst(self, batch: Sequence[SequenceShape]) -> float:
        """Weight of the batch once every sequence has generated all its remaining tokens."""
        ...

    def initial(self, batch: Sequence[SequenceShape]) -> float:
        """Weight of the batch as it is now (current lengths, nothing more generated)."""
        ...

    def prefill(self, group: Sequence[SequenceShape]) -> float:
        """Weight of the prefill forward pass over `group`."""
        ...

    def padding(self, group: Sequence[SequenceShape]) -> float:
        """Fraction of the prefill's input positions that are padding (0 for unpadded engines)."""
        ...

    def granular_fits(self, batch: Sequence[SequenceShape], candidate: SequenceShape) -> bool:
        """The granular check: does `candidate` fit beside `batch` at every point in time at which
        the batch shrinks, rather than in the worst case where all sequences peak together?"""
        ...


class Unlimited:
    """No memory model: every weight is 0 and the limit infinite, so only MAX_BATCH_SIZE applies."""

    max_weight: float = math.inf
    max_prefill_padding: float = 1.0

    def worst(self, batch: Sequence[SequenceShape]) -> float:
        return 0.0

    def initial(self, batch: Sequence[SequenceShape]) -> float:
        return 0.0

    def prefill(self, group: Sequence[SequenceShape]) -> float:
        return 0.0

    def padding(self, group: Sequence[SequenceShape]) -> float:
        return 0.0

    def granular_fits(self, batch: Sequence[SequenceShape], candidate: SequenceShape) -> bool:
        return True


@dataclass
class Selection:
    """Indices into the waiting list, in queue order, plus what the scan observed (for the metrics)."""

    indices: list[int] = field(default_factory=list)
    queue_jumps: int = 0  # tgi_queue_jump
    granular_additions: int = 0  # tgi_granular_batch_addition
    prefill_weight_skips: int = 0  # tgi_prefill_weight_limit_exceeded
    padding_skips: int = 0  # tgi_prefill_padding_limit_exceeded


QUEUE_JUMP_WINDOW_SECONDS = 1.0
# Coefficients such as 100/(L·B) do not multiply back to exactly 100: an exact fit must stay a fit.
RELATIVE_TOLERANCE = 1e-9


def exceeds(weight: float, limit: float) -> bool:
    """`weight > limit`, ignoring float rounding of the order of RELATIVE_TOLERANCE."""
    return weight > limit + abs(limit) * RELATIVE_TOLERANCE


def prefill_limit(weights: BatchWeights, running: Sequence[SequenceShape]) -> float:
    """SPEC §6.3 step 2: Wmax with nothing running, else ⌊(1 − initial(running)/Wmax)·Wmax⌋,
    computed as ⌊Wmax − initial(running)⌋ (the same number, without the float round trip)."""
    limit = weights.max_weight
    if not running or math.isinf(limit):
        return limit
    return math.floor(limit - weights.initial(running) + abs(limit) * RELATIVE_TOLERANCE)


def too_large(weights: BatchWeights, shape: SequenceShape) -> str | None:
    """Why a request could never be admitted, even into an empty batch (None: it can be). Only a beam
    search's worst case can outgrow the limit: validation keeps every sequence within it."""
    weight = weights.worst([shape])
    if exceeds(weight, weights.max_weight):
        return f"its worst case needs {weight:g} of the batch's {weights.max_weight:g} (KV blocks or tokens)"
    return None


@dataclass
class Admission:
    """Which queued requests join the running batch and when (SPEC §6.2-§6.3): the gates both runners use."""

    max_batch_size: int
    max_waiting_tokens: int
    weights: BatchWeights = field(default_factory=Unlimited)

    def min_group_size(self, running: int, steps_since_prefill: int) -> int:
        """How many waiting requests justify interrupting decoding for a prefill (SPEC §6.2 b)."""
        if running <= 1 or steps_since_prefill >= self.max_waiting_tokens:
            return 1
        waited = self.max_waiting_tokens - steps_since_prefill
        return max(1, running * waited // self.max_waiting_tokens)

    def select(
        self, waiting: Sequence[Candidate], running: Sequence[SequenceShape], min_size: int
    ) -> Selection:
        """Scan the queue in FIFO order and pick the group to prefill next (SPEC §6.3).

        Giving up (min_size out of reach after a skip) returns an empty `Selection`, counters
        included, as TGIS returns no batch at all there.
        """
        selection = Selection()
        if len(waiting) < min_size or len(running) + min_size > self.max_batch_size:
            return selection
        weights = self.weights
        limit = weights.max_weight
        prefill_room = prefill_limit(weights, running)
        if prefill_room <= 0:
            return selection
        chosen: list[SequenceShape] = []
        cut_off: float | None = None
        for index, candidate in enumerate(waiting):
            if cut_off is not None and candidate.queued_at > cut_off:
                break
            entry = candidate.shape
            batch = [*running, *chosen]
            if exceeds(weights.worst([*batch, entry]), limit):
                if not weights.granular_fits(batch, entry):
                    if len(chosen) + (len(waiting) - index - 1) < min_size:
                        return Selection()  # min_size is out of reach: give up entirely, as TGIS does
                    if cut_off is None:
                        cut_off = candidate.queued_at + QUEUE_JUMP_WINDOW_SECONDS
                    continue
                selection.granular_additions += 1
            group = [*chosen, entry]
            if exceeds(weights.prefill(group), prefill_room):
                selection.prefill_weight_skips += 1
            elif exceeds(weights.padding(group), weights.max_prefill_padding):
                selection.padding_skips += 1
            else:
                if cut_off is not None:
                    selection.queue_jumps += 1
                chosen.append(entry)
                selection.indices.append(index)
                if len(running) + len(chosen) >= self.max_batch_size:
                    break
                continue
            if cut_off is None:
                cut_off = candidate.queued_at + QUEUE_JUMP_WINDOW_SECONDS
        return selection
