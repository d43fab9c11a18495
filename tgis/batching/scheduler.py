"""Decides which queued requests join the running batch and when (SPEC §6.2–§6.3); pure, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SequenceShape:
    """What batch accounting needs of one request: tokens in (incl. prefix) and tokens still to come."""

    input_length: int
    remaining_new_tokens: int


@dataclass(frozen=True)
class Candidate:
    shape: SequenceShape
    queued_at: float


class BatchWeights(Protocol):
    """Memory model for admission; `Unlimited` leaves MAX_BATCH_SIZE as the only bound."""

    def fits(self, batch: Sequence[SequenceShape]) -> bool: ...

    def prefill_fits(self, running: Sequence[SequenceShape], group: Sequence[SequenceShape]) -> bool: ...


class Unlimited:
    def fits(self, batch: Sequence[SequenceShape]) -> bool:
        return True

    def prefill_fits(self, running: Sequence[SequenceShape], group: Sequence[SequenceShape]) -> bool:
        return True


@dataclass
class Selection:
    """Indices into the waiting list, in queue order, plus what the scan observed."""

    indices: list[int] = field(default_factory=list)
    queue_jumps: int = 0


QUEUE_JUMP_WINDOW_SECONDS = 1.0


@dataclass
class Scheduler:
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
        """Scan the queue in FIFO order and pick the group to prefill next (SPEC §6.3)."""
        selection = Selection()
        if len(waiting) < min_size or len(running) + min_size > self.max_batch_size:
            return selection
        chosen: list[SequenceShape] = []
        cut_off: float | None = None
        for index, candidate in enumerate(waiting):
            if cut_off is not None and candidate.queued_at > cut_off:
                break
            trial = [*chosen, candidate.shape]
            if not self.weights.fits([*running, *trial]):
                if len(chosen) + (len(waiting) - index - 1) < min_size:
                    return Selection()  # min_size is out of reach: give up entirely, as TGIS does
                if cut_off is None:
                    cut_off = candidate.queued_at + QUEUE_JUMP_WINDOW_SECONDS
                continue
            if not self.weights.prefill_fits(running, trial):
                if cut_off is None:
                    cut_off = candidate.queued_at + QUEUE_JUMP_WINDOW_SECONDS
                continue
            if cut_off is not None:
                selection.queue_jumps += 1
            chosen.append(candidate.shape)
            selection.indices.append(index)
            if len(running) + len(chosen) >= self.max_batch_size:
                break
        return selection
