"""When to speculate: not above SPECULATOR_MAX_BATCH_SIZE running sequences; not at a batch size where it
measures slower than plain decoding on this machine and model; and, per sequence, not while its recent
proposals are mostly rejected (a rejected proposal costs a wider step for nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field

SEQUENCE_ACCEPTANCE_WEIGHT = 0.3  # weight of the newest step in a sequence's acceptance average
MIN_ACCEPTANCE = 0.25  # below this recent acceptance a sequence stops proposing...
# ...for this many steps, then tries again. Short: a failed draft shrinks to one token (about a tenth
# of a step on a 2-core CPU), while a long pause misses every run of matches that starts inside it
# (16 steps paused 17-22 % of the benchmark model's steps; docs/benchmark/speculation-defaults/).
PAUSE_STEPS = 4
DRAFT_GROWTH = 2  # a draft accepted whole lets the next one be this many tokens longer
# A mode's cost is its recent seconds over its recent tokens, both summed with this decay per step of
# that mode: a step weighs as many tokens as it emitted, so one rejected draft (a wide step for a single
# token) moves the estimate by its share of the work, not by a fixed fraction of it.
COST_DECAY = 0.9
# The first SETTLING_STEPS steps after a switch of mode are not measured: they still pay for the other
# mode's aftermath (CostGate). At a batch size, the mode not chosen runs PROBE_STEPS steps in a row in
# every PROBE_EVERY, so that the steps after the settling ones measure it again.
SETTLING_STEPS = 3
PROBE_EVERY = 64
PROBE_STEPS = 6


@dataclass
class SequenceGate:
    """One sequence's recent acceptance (an exponential average), its pause, and how long a draft it
    brings: `draft_length` grows by DRAFT_GROWTH after a draft accepted whole (up to `max_length`) and
    falls to one past what was accepted after a rejection, so a sequence copying a long span proposes
    long drafts and one whose drafts break early stops paying for positions it will not keep."""

    max_length: int = 1
    acceptance: float = 1.0  # optimistic: a new sequence speculates at once
    paused_for: int = 0
    draft_length: int = field(init=False)

    def __post_init__(self) -> None:
        self.draft_length = self.max_length  # optimistic too

    def allows(self) -> bool:
        if self.paused_for > 0:
            self.paused_for -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if accepted >= proposed:
            self.draft_length = min(self.max_length, self.draft_length + DRAFT_GROWTH)
        else:
            self.draft_length = accepted + 1
        self.acceptance += SEQUENCE_ACCEPTANCE_WEIGHT * (accepted / proposed - self.acceptance)
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


@dataclass
class _RecentCost:
    """Seconds and tokens of one mode's recent steps, each an exponentially decayed sum."""

    seconds: float = 0.0
    tokens: float = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds = self.seconds * COST_DECAY + seconds
        self.tokens = self.tokens * COST_DECAY + tokens

    @property
    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


@dataclass
class _ModeCosts:
    """Seconds per emitted token of decode steps at one batch size, with drafts and without."""

    speculating: _RecentCost = field(default_factory=_RecentCost)
    plain: _RecentCost = field(default_factory=_RecentCost)
    decisions: int = 0


class CostGate:
    """Speculation pays only where verifying a draft costs less than the tokens it saves: a draft widens
    the step, and the proposer takes time of its own (an MLP speculator's heads are a forward pass). The
    gate measures, per decode batch size (in powers of two), the seconds per emitted token of pure
    decode steps with drafts and without, and takes the cheaper mode; the other mode runs a few steps
    in every PROBE_EVERY so that the choice follows changes in acceptance and load. Output does not
    depend on the mode (verification emits what plain decoding would), only speed does.

    The first SETTLING_STEPS steps after a switch of mode are not measured: they carry the other mode's
    aftermath (the tokens of speculating steps, several per sequence, are still being streamed by the
    event loop, which shares the cores and the interpreter with the engine). Measured alone, single
    probes of plain decoding amid speculating steps cost 1.4-3 ms a token with the demo model and its
    MLP speculator at concurrency 4 (AVX2 EPYC, 2 cores), where plain decoding in steady state costs
    1.3 ms: the gate kept a speculator that was slower than plain decoding. At 16 streams one settling
    step was not enough (about 40 tokens a step are still being streamed): with three, and probes of
    six, the demo MLP speculator's mixed workload ran 1.075x as fast as with one (median of six
    alternated rounds; 0.95x plain decoding became 1.075x) on that EPYC, and 1.06x (0.78-1.20, ten
    rounds) on a 2-core AVX-512 Xeon. Both comparisons served the old gate from a second checkout in
    a way that may have served the new one twice, so they are unconfirmed. Two more probe steps in 64
    should cost a stream that gains 3.5 tokens a step about 1.5 % (estimated from step times, not
    measured apart). At 16 streams the per-step comparison holds: timing every step of one server
    whose modes alternated in blocks of 16 (demo model and MLP speculator, grounded workload, 2-core
    Xeon), speculating steps cost 0.55-0.58 ms a token and plain ones 0.61-0.65, and only the first
    plain step after a switch was dearer. Such a server still read a few percent slower than
    speculation off in paired rounds while a proposal waited 6-9 ms on the GIL there. The cost was
    in the step thread's torch calls, each a chance to wait for the GIL behind the event loop: with
    the speculator's stages in six calls it read 0.955 of off in 40 paired rounds, and with the
    step's outputs gathered in one call and greedy drafts verified in one sampler call, 1.006
    (docs/benchmark/speculation.md)."""

    def __init__(self) -> None:
        self._costs: dict[int, _ModeCosts] = {}
        self._last_mode: bool | None = None  # whether the last step recorded speculated
        self._settling = 0  # steps still to go unmeasured after the last switch of mode

    @staticmethod
    def bucket(decoding: int) -> int:
        return 1 << max(decoding - 1, 0).bit_length()

    def allows(self, decoding: int) -> bool:
        costs = self._costs.setdefault(self.bucket(decoding), _ModeCosts())
        costs.decisions += 1
        speculating, plain = costs.speculating.per_token, costs.plain.per_token
        if speculating is None:
            return True  # optimistic: measure speculation first
        if plain is None:
            return False
        probe = (costs.decisions - 1) % PROBE_EVERY >= PROBE_EVERY - PROBE_STEPS
        return (speculating <= plain) != probe

    def record(self, decoding: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A pure decode step of `decoding` sequences that emitted `tokens` in `seconds` (from before
        the proposal until the next step began: its tokens' stop rules and hand-off included)."""
        if self._last_mode is not None and speculated != self._last_mode:
            self._settling = SETTLING_STEPS
        self._last_mode = speculated
        if self._settling > 0:
            self._settling -= 1
            return
        if tokens <= 0 or seconds <= 0:
            return
        costs = self._costs.setdefault(self.bucket(decoding), _ModeCosts())
        (costs.speculating if speculated else costs.plain).add(seconds, tokens)
