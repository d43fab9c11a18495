"""When to speculate: not above SPECULATOR_MAX_BATCH_SIZE running sequences, and, per sequence, not while
its recent proposals are mostly rejected (a rejected proposal costs a wider step for nothing)."""

from __future__ import annotations

from dataclasses import dataclass

ACCEPTANCE_WINDOW = 0.3  # weight of the newest step in a sequence's acceptance average
MIN_ACCEPTANCE = 0.25  # below this recent acceptance a sequence stops proposing...
PAUSE_STEPS = 16  # ...for this many steps, then tries again


@dataclass
class SequenceGate:
    """One sequence's recent acceptance (an exponential average) and its pause."""

    acceptance: float = 1.0  # optimistic: a new sequence speculates at once
    paused_for: int = 0

    def allows(self) -> bool:
        if self.paused_for > 0:
            self.paused_for -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.acceptance += ACCEPTANCE_WINDOW * (accepted / proposed - self.acceptance)
        if self.acceptance < MIN_ACCEPTANCE:
            self.paused_for = PAUSE_STEPS
            self.acceptance = MIN_ACCEPTANCE  # it comes back on probation, not already condemned


@dataclass(frozen=True)
class BatchGate:
    """Speculation widens every step it is in; beyond this many decoding sequences the step is no
    longer bound by reading the weights, so the extra positions cost more than they save."""

    max_batch_size: int

    def allows(self, decoding: int) -> bool:
        return decoding <= self.max_batch_size
