"""The startup check that one request of MAX_SEQUENCE_LENGTH tokens fits the batch weights (SPEC §6.4)."""

from __future__ import annotations

from tgis.batching.admission import BatchWeights, SequenceShape, exceeds
from tgis.errors import StartupError


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def check_max_length_fits(weights: BatchWeights, max_sequence_length: int) -> None:
    """SPEC §6.4: one request of MAX_SEQUENCE_LENGTH tokens must fit, else startup fails."""
    one = [SequenceShape(input_length=max_sequence_length, remaining_new_tokens=0)]
    capacity = weights.max_weight
    for kind, weight in (("prefill", weights.prefill(one)), ("next-token", weights.worst(one))):
        if exceeds(weight, capacity):
            raise StartupError(
                f"The provided max_sequence length ({max_sequence_length}) results in a {kind} batch "
                f"weight that exceeds the estimated capacity ({_number(capacity)})"
            )
