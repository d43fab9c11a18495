"""When to speculate: below the batch limit, where it measures cheaper per token, and per sequence while
its drafts are mostly accepted."""

from __future__ import annotations

from tgis.speculation.gate import (
    DRAFT_GROWTH,
    PAUSE_STEPS,
    PROBE_EVERY,
    PROBE_STEPS,
    SETTLING_STEPS,
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
    # Speculation measured first, then plain decoding: its first SETTLING_STEPS steps follow a switch
    # and are not measured, so it runs one more.
    measured_both = 1 + SETTLING_STEPS + 1
    assert chosen[: measured_both + 1] == [True] + [False] * (SETTLING_STEPS + 1) + [True]
    probes = len(chosen) // PROBE_EVERY * PROBE_STEPS
    assert PROBE_STEPS > SETTLING_STEPS  # a probe measures something
    assert chosen[measured_both:].count(False) == probes  # then only the probes, PROBE_STEPS in a row
    assert chosen[PROBE_EVERY - PROBE_STEPS : PROBE_EVERY] == [False] * PROBE_STEPS
    slower = _decide(CostGate(), 1, {True: 0.006, False: 0.005}, 4 * PROBE_EVERY)
    assert slower[measured_both:].count(True) == probes


def test_the_steps_right_after_a_switch_of_mode_are_not_measured() -> None:
    """Plain steps right after speculating ones pay for their tokens still being streamed: measured,
    a probe would make plain decoding look dearer than it is, and the gate would keep speculating."""
    gate = CostGate()
    assert gate.allows(1)
    gate.record(1, True, seconds=0.008, tokens=4)  # speculating: 2 ms a token
    for _ in range(SETTLING_STEPS):
        assert not gate.allows(1)  # plain decoding is measured next
        gate.record(1, False, seconds=0.009, tokens=1)  # the aftermath, 9 ms a step: not measured
    assert not gate.allows(1)  # so plain decoding runs again
    gate.record(1, False, seconds=0.0015, tokens=1)  # in steady state, 1.5 ms a token
    assert not gate.allows(1)  # cheaper than speculating: kept
    # Back to speculating (a probe): its settling steps are not measured either, however dear.
    gate = CostGate()
    _decide(gate, 1, {True: 0.002, False: 0.005}, PROBE_EVERY)  # ends right after a plain probe
    for _ in range(SETTLING_STEPS):
        assert gate.allows(1)
        gate.record(1, True, seconds=1.0, tokens=1)
    assert gate.allows(1)  # still speculating: those steps were not costs


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
    assert chosen[SETTLING_STEPS + 2 :].count(False) <= len(chosen) // PROBE_EVERY * PROBE_STEPS
