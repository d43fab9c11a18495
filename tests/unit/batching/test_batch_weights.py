"""Padded / unpadded batch weights, the granular check, the startup fit check and warm-up shapes."""

from __future__ import annotations

import pytest

from tgis.batching.admission import SequenceShape, Unlimited
from tgis.batching.batch_weights import (
    MemoryCoefficients,
    PaddedWeights,
    UnpaddedWeights,
    longest_admitted_input,
    longest_request,
    warmup_shapes,
    weights_for,
)
from tgis.errors import StartupError
from tgis.startup.fit import check_max_length_fits

COEFFICIENTS = MemoryCoefficients(a=2.0, b=1.0, c=0.5, d=3.0, e=4.0)
BATCH = [SequenceShape(10, 5), SequenceShape(20, 1), SequenceShape(15, 8)]  # in 45, out 14, n 3


def shape(tokens_in: int, tokens_out: int) -> SequenceShape:
    return SequenceShape(input_length=tokens_in, remaining_new_tokens=tokens_out)


UNIT = MemoryCoefficients(a=1.0, b=0.0, c=0.0, d=1.0, e=1.0)


# ---------------------------------------------------------------- arithmetic


def test_padded_weights_arithmetic() -> None:
    weights = PaddedWeights(COEFFICIENTS, 1000, 0.2)
    assert weights.next_token_coefficient == 4.0  # max(d, e)
    assert weights.worst(BATCH) == (20 + 8) * 3 * 4.0
    assert weights.initial(BATCH) == 20 * 3 * 4.0
    # T = 3·20 = 60: max(60·a, 60·b + 60·20·c) = max(120, 660)
    assert weights.prefill(BATCH) == 660.0
    assert weights.padding(BATCH) == pytest.approx((60 - 45) / 60)


def test_padded_prefill_takes_the_linear_term_when_it_is_larger() -> None:
    weights = PaddedWeights(MemoryCoefficients(a=50.0, b=1.0, c=0.5, d=1.0, e=1.0), 1000, 0.2)
    assert weights.prefill(BATCH) == 60 * 50.0


def test_unpadded_weights_arithmetic() -> None:
    weights = UnpaddedWeights(COEFFICIENTS, 1000, 0.2)
    assert weights.worst(BATCH) == (45 + 14) * 4.0  # g_nt = e
    assert weights.initial(BATCH) == 45 * 4.0
    assert weights.prefill(BATCH) == 45 * 2.0  # g_p = a
    assert weights.padding(BATCH) == 0.0


@pytest.mark.parametrize("kind", [PaddedWeights, UnpaddedWeights])
def test_empty_batches_weigh_nothing(kind: type[PaddedWeights] | type[UnpaddedWeights]) -> None:
    weights = kind(COEFFICIENTS, 1000, 0.2)
    assert weights.worst([]) == weights.initial([]) == weights.prefill([]) == weights.padding([]) == 0.0


def test_padding_of_equal_lengths_is_zero() -> None:
    weights = PaddedWeights(COEFFICIENTS, 1000, 0.2)
    assert weights.padding([shape(7, 1)] * 4) == 0.0


def test_weights_for_picks_the_model() -> None:
    assert isinstance(weights_for(COEFFICIENTS, 10, 0.2, padded=True), PaddedWeights)
    unpadded = weights_for(COEFFICIENTS, 10, 0.3, padded=False)
    assert isinstance(unpadded, UnpaddedWeights)
    assert (unpadded.max_weight, unpadded.max_prefill_padding) == (10, 0.3)


# ---------------------------------------------------------------- granular check

# Running (in 30, out 50) and (in 5, out 5); candidate (in 10, out 20). g = 1.
RUNNING = [shape(30, 50), shape(5, 5)]
CANDIDATE = shape(10, 20)


def test_padded_granular_check_boundary() -> None:
    # Longest out first: (50, 30) is not checked (out > 20); (20, 10): M = 30, (30 + 20)·2 = 100;
    # (5, 5): M = 30, (30 + 5)·3 = 105. So the batch fits exactly at Wmax 105.
    assert PaddedWeights(UNIT, 105, 0.2).granular_fits(RUNNING, CANDIDATE)
    assert not PaddedWeights(UNIT, 104, 0.2).granular_fits(RUNNING, CANDIDATE)


def test_unpadded_granular_check_boundary() -> None:
    # (20, 10): I = 40, 40 + 2·20 = 80; (5, 5): I = 45, 45 + 3·5 = 60. Fits exactly at Wmax 80.
    assert UnpaddedWeights(UNIT, 80, 0.2).granular_fits(RUNNING, CANDIDATE)
    assert not UnpaddedWeights(UNIT, 79, 0.2).granular_fits(RUNNING, CANDIDATE)


def test_granular_check_scales_with_the_next_token_coefficient() -> None:
    # Padded uses max(d, e) = 2: 105·2 = 210.
    coefficients = MemoryCoefficients(a=1.0, b=0.0, c=0.0, d=2.0, e=0.5)
    assert PaddedWeights(coefficients, 210, 0.2).granular_fits(RUNNING, CANDIDATE)
    assert not PaddedWeights(coefficients, 209, 0.2).granular_fits(RUNNING, CANDIDATE)
    # Unpadded uses e = 0.5: 80·0.5 = 40.
    assert UnpaddedWeights(coefficients, 40, 0.2).granular_fits(RUNNING, CANDIDATE)
    assert not UnpaddedWeights(coefficients, 39, 0.2).granular_fits(RUNNING, CANDIDATE)


def test_granular_check_of_the_longest_candidate_covers_every_point() -> None:
    longest = shape(10, 100)
    # Unpadded: (100, 10): 10 + 100 = 110; (50, 30): 40 + 2·50 = 140; (5, 5): 45 + 3·5 = 60.
    assert UnpaddedWeights(UNIT, 140, 0.2).granular_fits(RUNNING, longest)
    assert not UnpaddedWeights(UNIT, 139, 0.2).granular_fits(RUNNING, longest)


def test_granular_check_is_never_looser_than_one_sequence_alone() -> None:
    assert not PaddedWeights(UNIT, 99, 0.2).granular_fits([], shape(50, 50))
    assert PaddedWeights(UNIT, 100, 0.2).granular_fits([], shape(50, 50))


# ---------------------------------------------------------------- startup check


@pytest.mark.parametrize("padded", [True, False])
def test_startup_check_prefill_message(padded: bool) -> None:
    # Prefill of 100 tokens at a = 2 weighs 200 > 150.
    weights = weights_for(MemoryCoefficients(a=2.0, b=0.0, c=0.0, d=1.0, e=1.0), 150, 0.2, padded=padded)
    with pytest.raises(StartupError) as error:
        check_max_length_fits(weights, 100)
    assert str(error.value) == (
        "The provided max_sequence length (100) results in a prefill batch weight that exceeds "
        "the estimated capacity (150)"
    )


@pytest.mark.parametrize("padded", [True, False])
def test_startup_check_next_token_message(padded: bool) -> None:
    # Prefill 100·1 = 100 fits; next-token 100·2 = 200 > 150.
    weights = weights_for(MemoryCoefficients(a=1.0, b=0.0, c=0.0, d=2.0, e=2.0), 150, 0.2, padded=padded)
    with pytest.raises(StartupError) as error:
        check_max_length_fits(weights, 100)
    assert str(error.value) == (
        "The provided max_sequence length (100) results in a next-token batch weight that exceeds "
        "the estimated capacity (150)"
    )


def test_startup_check_passes_on_an_exact_fit_and_for_unlimited() -> None:
    check_max_length_fits(weights_for(UNIT, 100, 0.2, padded=True), 100)
    check_max_length_fits(Unlimited(), 10**9)


def test_longest_request_is_the_boundary_of_the_startup_check() -> None:
    weights = weights_for(MemoryCoefficients(a=1.0, b=0.0, c=0.0, d=2.0, e=2.0), 150, 0.2, padded=True)
    assert longest_request(weights, 1000) == 75
    check_max_length_fits(weights, 75)
    with pytest.raises(StartupError):
        check_max_length_fits(weights, 76)
    assert longest_request(weights, 50) == 50
    assert longest_request(Unlimited(), 4096) == 4096


# ---------------------------------------------------------------- warm-up shapes


def test_longest_admitted_input_for_a_batch() -> None:
    # Padded, g = 1, Wmax 100: n rows of (l + 1) tokens must fit: l = ⌊100/n⌋ − 1.
    weights = weights_for(UNIT, 100, 0.2, padded=True)
    assert [longest_admitted_input(weights, n, 1000) for n in (1, 2, 3, 50, 51)] == [99, 49, 32, 1, 0]
    assert longest_admitted_input(weights, 1, 20) == 20


def test_warmup_shapes_cover_the_admitted_extremes() -> None:
    weights = weights_for(UNIT, 100, 0.2, padded=True)
    shapes = warmup_shapes(weights, max_sequence_length=256, max_batch_size=64, count=10, seed=3)
    assert len(shapes) == 10
    assert shapes == sorted(set(shapes))
    assert (1, 99) in shapes  # the longest single input
    assert (50, 1) in shapes  # the largest batch, at its longest input
    for size, length in shapes:
        assert 1 <= size <= 50
        assert 1 <= length <= longest_admitted_input(weights, size, 255)
    assert warmup_shapes(weights, 256, 64, count=10, seed=3) == shapes


def test_warmup_shapes_when_unlimited_reach_the_configured_maxima() -> None:
    shapes = warmup_shapes(Unlimited(), max_sequence_length=64, max_batch_size=8, count=6, seed=0)
    assert (1, 63) in shapes and (8, 63) in shapes
    assert len(shapes) == 6


def test_warmup_shapes_empty_when_nothing_fits() -> None:
    weights = weights_for(UNIT, 1, 0.2, padded=True)  # even 1 + 1 tokens weigh 2 > 1
    assert warmup_shapes(weights, 64, 8) == []
    assert warmup_shapes(Unlimited(), 64, 8, count=0) == []
