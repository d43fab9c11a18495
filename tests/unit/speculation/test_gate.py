"""When to speculate: below the batch limit, where it measures cheaper per token, and per sequence while
its drafts are mostly accepted."""

from __future__ import annotations

from tgis.speculation.gate import (
    DRAFT_GROWTH,
    PAUSE_STEPS,
    PROBE_EVERY,
    PROBE_STEPS,
    BatchGate,
    CostGate,
    SequenceGate,
)


def test_a_sequence_whose_drafts_are_rejected_pauses_then_tries_again() -> None:
    gate = SequenceGate()
    steps = 0
    while gate.allows():
        gate.record(proposed=4, accepted=0)
        steps += 1
        assert steps < 20, "it never paused"
    paused = 1 + sum(not gate.allows() for _ in range(PAUSE_STEPS - 1))
    assert paused == PAUSE_STEPS
    assert gate.allows()


def test_a_sequence_whose_drafts_are_accepted_keeps_speculating() -> None:
    gate = SequenceGate()
    for _ in range(100):
        assert gate.allows()
        gate.record(proposed=4, accepted=3)


def test_steps_without_a_draft_change_nothing() -> None:
    gate = SequenceGate()
    gate.record(proposed=0, accepted=0)
    assert gate.acceptance == 1.0


def test_a_sequences_draft_length_follows_how_far_its_drafts_held() -> None:
    gate = SequenceGate(max_length=8)
    assert gate.draft_length == 8  # optimistic at first
    gate.record(proposed=8, accepted=3)
    assert gate.draft_length == 4  # one past what held
    gate.record(proposed=4, accepted=4)
    assert gate.draft_length == 4 + DRAFT_GROWTH
    for _ in range(8):
        gate.record(proposed=gate.draft_length, accepted=gate.draft_length)
    assert gate.draft_length == 8  # never past the limit
    gate.record(proposed=8, accepted=0)
    assert gate.draft_length == 1


def test_the_batch_gate_stops_speculation_above_its_size() -> None:
    gate = BatchGate(max_batch_size=4)
    assert gate.allows(4) and not gate.allows(5)
    assert not BatchGate(max_batch_size=0).allows(1)


def _decide(gate: CostGate, decoding: int, costs: dict[bool, float], steps: int) -> list[bool]:
    """Run `steps` decode steps where a token costs costs[mode] seconds; the modes chosen."""
    chosen = []
    for _ in range(steps):
        speculated = gate.allows(decoding)
        gate.record(decoding, speculated, seconds=costs[speculated] * 4, tokens=4)
        chosen.append(speculated)
    return chosen


def test_the_cost_gate_measures_both_modes_then_keeps_the_cheaper_one_probing_the_other() -> None:
    gate = CostGate()
    chosen = _decide(gate, 1, {True: 0.002, False: 0.005}, 4 * PROBE_EVERY)
    # Speculation measured first, then plain decoding: its first step follows a switch and is not
    # measured, so it runs a second one.
    assert chosen[:4] == [True, False, False, True]
    probes = len(chosen) // PROBE_EVERY * PROBE_STEPS
    assert chosen[3:].count(False) == probes  # then only the probes, PROBE_STEPS steps in a row
    assert chosen[PROBE_EVERY - PROBE_STEPS : PROBE_EVERY] == [False] * PROBE_STEPS
    slower = _decide(CostGate(), 1, {True: 0.006, False: 0.005}, 4 * PROBE_EVERY)
    assert slower[3:].count(True) == probes


def test_the_first_step_after_a_switch_of_mode_is_not_measured() -> None:
    """A plain step right after speculating ones pays for their tokens still being streamed: measured,
    a probe would make plain decoding look dearer than it is, and the gate would keep speculating."""
    gate = CostGate()
    assert gate.allows(1)
    gate.record(1, True, seconds=0.008, tokens=4)  # speculating: 2 ms a token
    assert not gate.allows(1)  # plain decoding is measured next
    gate.record(1, False, seconds=0.009, tokens=1)  # its first step: the aftermath, 9 ms
    assert not gate.allows(1)  # not measured: plain decoding runs again
    gate.record(1, False, seconds=0.0015, tokens=1)  # in steady state, 1.5 ms a token
    assert not gate.allows(1)  # cheaper than speculating: kept


def test_the_cost_gate_decides_per_batch_size_and_follows_a_change() -> None:
    gate = CostGate()
    _decide(gate, 1, {True: 0.002, False: 0.005}, 8)
    _decide(gate, 12, {True: 0.009, False: 0.005}, 8)  # a wide batch: speculation costs more there
    assert gate.allows(1) and not gate.allows(16)  # 12 and 16 share a bucket
    assert CostGate.bucket(1) == 1 and CostGate.bucket(3) == 4 and CostGate.bucket(9) == 16
    # Acceptance falls at batch 1: the probes see it and the gate turns speculation off.
    later = _decide(gate, 1, {True: 0.009, False: 0.005}, 6 * PROBE_EVERY)
    assert later[-PROBE_EVERY:].count(True) <= PROBE_STEPS  # only a probe


def test_steps_that_emitted_nothing_are_not_costs() -> None:
    gate = CostGate()
    gate.record(1, True, seconds=0.01, tokens=0)
    assert gate.allows(1) and gate.allows(1)  # still unmeasured: speculation is tried


def test_the_cost_gate_weighs_each_step_by_the_tokens_it_emitted() -> None:
    """Runs of rejected drafts (a wide step for one token) between accepted ones (a wide step for eight)
    cost 0.28 s per 14 tokens, 0.02 s a token: cheaper than plain decoding's 0.03 s a token, though each
    rejected step alone (0.04 s a token) is dearer. Averaging per-step costs would flip to plain decoding
    in every run of rejections; seconds over tokens keeps speculating but for the probes."""
    gate = CostGate()
    outcomes = [8, 1, 1, 1, 1, 1, 1]  # tokens each speculating step emits, in turn
    chosen = []
    for step in range(8 * PROBE_EVERY):
        speculated = gate.allows(1)
        if speculated:
            gate.record(1, True, seconds=0.04, tokens=outcomes[step % len(outcomes)])
        else:
            gate.record(1, False, seconds=0.03, tokens=1)
        chosen.append(speculated)
    assert chosen[3:].count(False) <= len(chosen) // PROBE_EVERY * PROBE_STEPS
