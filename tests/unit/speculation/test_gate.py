"""When to speculate: below the batch limit, and per sequence while its drafts are mostly accepted."""

from __future__ import annotations

from tgis.speculation.gate import PAUSE_STEPS, BatchGate, SequenceGate


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


def test_the_batch_gate_stops_speculation_above_its_size() -> None:
    gate = BatchGate(max_batch_size=4)
    assert gate.allows(4) and not gate.allows(5)
    assert not BatchGate(max_batch_size=0).allows(1)
