"""The memory model: manual coefficients (margin once), off/auto fallbacks, the fits of `auto` on a
fabricated engine and on a tiny real model, and the CPU live-tensor probe (SPEC §6.5)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import cast

import pytest
import torch

from engines import hf_transformers
from engines.base import Engine, EngineConfig, EngineSpec, PrefillResult, PrefillRow
from tgis.batching.admission import SequenceShape, Unlimited
from tgis.batching.batch_weights import (
    MemoryCoefficients,
    PaddedWeights,
    UnpaddedWeights,
    warmup_shapes,
)
from tgis.config import ServingLimits, Settings, StartupError
from tgis.startup import memory
from tgis.startup.fit import check_max_length_fits
from tgis.startup.memory import manual_coefficients, max_weight
from tgis.startup.memory_estimator import Estimator, EstimatorConfig, nonnegative_least_squares
from tgis.startup.memory_probe import LiveTensorPeak, MemoryBudgetExceeded

MIB = 1 << 20
LIMITS = ServingLimits(max_sequence_length=200, max_new_tokens=100)
NO_ENGINE = cast(Engine, object())  # off / manual never touch the engine


def settings(**values: object) -> Settings:
    return Settings.model_validate(values)


# ---------------------------------------------------------------- probe


def test_probe_peak_of_known_tensors() -> None:
    probe = LiveTensorPeak()
    with probe:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.empty(250, dtype=torch.float64)  # 2000 bytes
        view = b.view(25, 10)  # same storage: not counted again
        assert probe.live == probe.peak == 6000
        del a
        assert probe.live == 2000 and probe.peak == 6000
        c = torch.zeros(100, dtype=torch.int8)  # 100 bytes
        assert probe.live == 2100 and probe.peak == 6000
        probe.reset_peak()
        assert probe.peak == 2100
        del b, view, c
    assert probe.live == 0 and probe.peak == 2100


def test_probe_counts_temporaries_of_an_expression() -> None:
    x = torch.ones(1000)  # made before the probe: not counted
    probe = LiveTensorPeak()
    with probe:
        y = (x * 2) + 1  # x * 2 (4000 bytes) lives until + 1 (4000 bytes) is made
        assert probe.live == 4000
    assert probe.peak == 8000
    assert y.shape == x.shape


def test_probe_counts_tensors_made_under_inference_mode() -> None:
    probe = LiveTensorPeak()
    with torch.inference_mode(), probe:
        kept = torch.empty(512, dtype=torch.float32)
    assert probe.live == 2048 and kept.numel() == 512


def test_probe_budget_stops_the_op_that_goes_over() -> None:
    probe = LiveTensorPeak(budget=5000)
    with probe:
        kept = torch.empty(1000)  # 4000: within the budget
        with pytest.raises(MemoryBudgetExceeded):
            torch.empty(500)  # 6000 > 5000
    assert kept.numel() == 1000 and probe.live == 4000


# ---------------------------------------------------------------- least squares


def test_nonnegative_least_squares_recovers_an_exact_fit() -> None:
    features = [[float(x), float(x * x)] for x in range(1, 8)]
    targets = [3.0 * x + 0.5 * x * x for x in range(1, 8)]
    b, c = nonnegative_least_squares(features, targets)
    assert b == pytest.approx(3.0) and c == pytest.approx(0.5)


def test_nonnegative_least_squares_clamps_a_negative_coefficient_to_zero() -> None:
    features = [[float(x), float(x * x)] for x in range(1, 8)]
    targets = [10.0 * x - 0.5 * x * x for x in range(1, 8)]  # unconstrained: c < 0
    b, c = nonnegative_least_squares(features, targets)
    assert c == 0.0
    # With c fixed at 0 the best b is the one-column least squares.
    xs = [f[0] for f in features]
    expected = sum(x * t for x, t in zip(xs, targets, strict=True)) / sum(x * x for x in xs)
    assert b == pytest.approx(expected)


# ---------------------------------------------------------------- off / manual


def test_off_is_unlimited() -> None:
    assert isinstance(memory.estimate(settings(estimate_memory="off"), NO_ENGINE, LIMITS), Unlimited)


@pytest.mark.parametrize("padded", [True, False])
def test_manual_coefficients(padded: bool) -> None:
    coefficients = manual_coefficients(100, 4, padded=padded)
    per_token = 100 / (100 * 4)
    if padded:
        quadratic = 100 / (100**2 * 4)
        assert coefficients == MemoryCoefficients(a=0.0, b=0.0, c=quadratic, d=per_token, e=per_token)
    else:
        assert coefficients == MemoryCoefficients(a=per_token, b=0.0, c=0.0, d=per_token, e=per_token)


def test_manual_mode_applies_the_margin_once() -> None:
    """Capacity ≈ P·L·B tokens: with margin 20, L = 200 and B = 4, the batch holds 0.8·800 = 640."""
    weights = memory.estimate(settings(estimate_memory="manual", max_batch_size=4), NO_ENGINE, LIMITS)
    assert isinstance(weights, PaddedWeights)
    assert weights.max_weight == 80
    assert weights.max_prefill_padding == 0.2
    full = [SequenceShape(150, 10)] * 4  # 4 · 160 = 640 tokens
    assert weights.worst(full) == pytest.approx(80)
    assert weights.granular_fits(full[:3], full[3])
    assert weights.worst([*full[:3], SequenceShape(150, 11)]) > 80  # (150 + 11)·4 = 644 tokens
    assert not weights.granular_fits(full[:3], SequenceShape(151, 10))  # (151 + 10)·4 all at once
    # The prefill side: four inputs of 160 tokens weigh 4·160²·c = 51.2 of the 80.
    assert weights.prefill([SequenceShape(160, 1)] * 4) == pytest.approx(4 * 160 * 160 * 100 / (200**2 * 4))


def test_flash_attention_does_not_change_the_padded_engines_weights() -> None:
    """FLASH_ATTENTION asks for the paged step; an engine that pads is weighed as padded whatever it says."""
    flash = memory.estimate(
        settings(estimate_memory="manual", max_batch_size=4, flash_attention=True), NO_ENGINE, LIMITS
    )
    plain = memory.estimate(settings(estimate_memory="manual", max_batch_size=4), NO_ENGINE, LIMITS)
    assert not isinstance(flash, UnpaddedWeights)
    assert flash == plain


def test_manual_mode_unpadded_weights_for_an_unpadded_engine() -> None:
    weights = memory.estimate(
        settings(estimate_memory="manual", max_batch_size=4), NO_ENGINE, LIMITS, padded=False
    )
    assert isinstance(weights, UnpaddedWeights)
    assert weights.worst([SequenceShape(600, 40)]) == pytest.approx(80)  # 640 tokens · 100/800


def test_manual_startup_check_with_the_default_margin_fails_for_batch_size_one() -> None:
    """One request of L tokens needs all of L·B = L tokens, but only 80 % of them may be used."""
    weights = memory.estimate(settings(estimate_memory="manual", max_batch_size=1), NO_ENGINE, LIMITS)
    with pytest.raises(StartupError) as error:
        check_max_length_fits(weights, LIMITS.max_sequence_length)
    assert str(error.value) == (
        "The provided max_sequence length (200) results in a prefill batch weight that exceeds "
        "the estimated capacity (80)"
    )


@pytest.mark.parametrize(("batch_size", "margin"), [(2, 20), (1, 0), (5, 80)])
def test_manual_startup_check_passes_when_one_request_fits(batch_size: int, margin: int) -> None:
    weights = memory.estimate(
        settings(estimate_memory="manual", max_batch_size=batch_size, batch_safety_margin=margin),
        NO_ENGINE,
        LIMITS,
    )
    check_max_length_fits(weights, LIMITS.max_sequence_length)


def test_max_weight_is_the_floor_of_the_usable_part() -> None:
    assert max_weight(100, 20) == 80
    assert max_weight(1001, 10) == 900  # ⌊900.9⌋
    assert max_weight(100, 100) == 0


# ---------------------------------------------------------------- auto fallbacks


def test_auto_on_cpu_without_budget_is_unlimited(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(lambda n, length: 0)
    with caplog.at_level(logging.INFO, logger="tgis.startup.memory"):
        weights = memory.estimate(settings(), cast(Engine, engine), LIMITS)
    assert isinstance(weights, Unlimited)
    assert engine.prefills == []
    assert [r.message for r in caplog.records] == [
        "ESTIMATE_MEMORY=auto on CPU without CPU_MEMORY_BUDGET_MB: no memory limit, "
        "only MAX_BATCH_SIZE bounds the batch"
    ]


def test_pt2_compile_forces_auto(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tgis.startup.memory"):
        engine = cast(Engine, FakeEngine(lambda n, length: 0))
        weights = memory.estimate(settings(estimate_memory="off", pt2_compile=True), engine, LIMITS)
    assert isinstance(weights, Unlimited)  # auto, but on CPU without a budget
    assert "ESTIMATE_MEMORY=off becomes auto" in caplog.text


# ---------------------------------------------------------------- auto on a fabricated engine

VOCAB = 50


class FakeEngine:
    """Records shapes; a FakeMeter turns them into peaks with known coefficients."""

    def __init__(self, prefill_peak: Callable[[int, int], float]) -> None:
        self.spec = EngineSpec(
            is_encoder_decoder=False,
            vocab_size=VOCAB,
            eos_token_ids=(0,),
            pad_token_id=0,
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        self.prefill_peak = prefill_peak
        self.prefills: list[tuple[int, int]] = []
        self.rows: list[int] = []  # current length of each row
        self.generated = 0
        self.last_peak = 0.0

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def prefill(self, rows: Sequence[PrefillRow]) -> PrefillResult:
        assert not self.rows, "the estimator prefills an empty engine"
        lengths = {len(row.input_ids) for row in rows}
        assert len(lengths) == 1 and all(0 <= i < VOCAB for row in rows for i in row.input_ids)
        length = lengths.pop()
        self.prefills.append((len(rows), length))
        self.rows = [length] * len(rows)
        self.last_peak = self.prefill_peak(len(rows), length)
        return PrefillResult(torch.zeros(len(rows), VOCAB), [None] * len(rows))

    def decode(self, token_ids: Sequence[int]) -> torch.Tensor:
        assert len(token_ids) == len(self.rows)
        self.generated += 1
        n, length = len(self.rows), self.rows[0]
        self.last_peak = 7.0 * n * length + 9.0 * n * self.generated  # d = 7, e = 9
        return torch.zeros(n, VOCAB)

    def keep_rows(self, indices: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in indices]

    def clear(self) -> None:
        self.rows = []
        self.generated = 0


class FakeMeter:
    def __init__(self, engine: FakeEngine, free_bytes: int) -> None:
        self.engine = engine
        self.free_bytes = free_bytes

    def tracking(self) -> AbstractContextManager[None]:
        return nullcontext()

    def reset_peak(self) -> None:
        self.engine.last_peak = 0.0

    def peak(self) -> int:
        return round(self.engine.last_peak)


def linear_then_quadratic(n: int, length: int) -> float:
    """a = 100 up to 45 tokens per row, then b = 10, c = 2 (10 + 2·45 = 100 at the crossover)."""
    tokens = n * length
    return max(100.0 * tokens, 10.0 * tokens + 2.0 * tokens * length)


def config(**overrides: int | float) -> EstimatorConfig:
    values: dict[str, int | float] = {
        "batch_size": 4,
        "min_samples": 5,
        "start_seq_len": 20,
        "stop_seq_len": 1500,
        "fit_threshold": 0.02,
        "new_tokens": 6,
        "new_token_samples": 2,
        "max_sequence_length": 2048,
    }
    values.update(overrides)
    return EstimatorConfig(**values)  # type: ignore[arg-type]


def test_auto_fit_recovers_known_coefficients() -> None:
    engine = FakeEngine(linear_then_quadratic)
    free = 10_000_000
    estimator = Estimator(cast(Engine, engine), FakeMeter(engine, free), config())
    coefficients = estimator.fit()
    assert coefficients.a == pytest.approx(100.0)
    assert coefficients.b == pytest.approx(10.0)
    assert coefficients.c == pytest.approx(2.0)
    assert coefficients.d == pytest.approx(7.0)
    assert coefficients.e == pytest.approx(9.0)
    assert engine.num_rows == 0  # left empty for serving
    # Every probe used the configured batch size.
    assert {n for n, _ in engine.prefills} == {4}


def test_auto_binary_search_brackets_the_longest_prefill() -> None:
    engine = FakeEngine(linear_then_quadratic)
    free = 10_000_000
    estimator = Estimator(cast(Engine, engine), FakeMeter(engine, free), config())
    bound = estimator.longest_prefill()
    assert linear_then_quadratic(4, bound) <= free
    # The search stops once the interval is below 10: the true limit is less than 10 further.
    assert linear_then_quadratic(4, bound + 10) > free
    assert all(20 <= length <= 1500 for _, length in engine.prefills)


def test_auto_search_is_capped_by_stop_and_max_sequence_length() -> None:
    engine = FakeEngine(linear_then_quadratic)
    meter = FakeMeter(engine, 10**12)
    assert Estimator(cast(Engine, engine), meter, config(stop_seq_len=300)).longest_prefill() == 300
    assert Estimator(cast(Engine, engine), meter, config(max_sequence_length=128)).longest_prefill() == 128


def test_auto_never_breaking_linearity_gives_no_quadratic_term(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(lambda n, length: 64.0 * n * length)
    estimator = Estimator(cast(Engine, engine), FakeMeter(engine, 10**12), config(stop_seq_len=400))
    with caplog.at_level(logging.INFO, logger="tgis.startup.memory"):
        coefficients = estimator.fit()
    assert (coefficients.a, coefficients.b, coefficients.c) == (pytest.approx(64.0), 0.0, 0.0)
    assert "no quadratic term (b = c = 0)" in caplog.text


def test_auto_decode_samples_stay_below_three_quarters_of_the_bound() -> None:
    engine = FakeEngine(lambda n, length: 64.0 * n * length)
    estimator = Estimator(cast(Engine, engine), FakeMeter(engine, 10**12), config(stop_seq_len=400))
    d, e = estimator.fit_next_token(400)
    assert (d, e) == (pytest.approx(7.0), pytest.approx(9.0))
    decode_lengths = [length for _, length in engine.prefills]
    assert decode_lengths and all(length < 0.75 * 400 for length in decode_lengths)
    assert len(set(decode_lengths)) == 2


def test_auto_fails_startup_when_the_shortest_probe_does_not_fit() -> None:
    engine = FakeEngine(linear_then_quadratic)
    estimator = Estimator(cast(Engine, engine), FakeMeter(engine, 1000), config())
    with pytest.raises(StartupError, match="a batch of 4 sequences of 20 tokens does not fit"):
        estimator.fit()
    assert engine.num_rows == 0


# ---------------------------------------------------------------- auto on a tiny real model


@pytest.fixture(scope="module")
def gpt2_engine(model_dirs: Callable[[str], Path]) -> Iterator[Engine]:
    yield hf_transformers.load_padded(EngineConfig(model_path=model_dirs("gpt2")))


def peak_of(engine: Engine, batch_size: int, length: int) -> int:
    engine.clear()
    probe = LiveTensorPeak()
    with probe:
        engine.prefill([PrefillRow([5 + i % 100 for i in range(length)]) for _ in range(batch_size)])
        engine.decode([7] * batch_size)
    engine.clear()
    return probe.peak


def test_auto_on_cpu_with_a_budget(gpt2_engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    budget_mb = 2
    stop = 160
    assert peak_of(gpt2_engine, 4, stop) > budget_mb * MIB  # so the search has to find the bound
    values = {
        "cpu_memory_budget_mb": budget_mb,
        "estimate_memory_batch_size": 4,
        "estimate_memory_start_seq_len": 8,
        "estimate_memory_stop_seq_len": stop,
        "estimate_memory_min_samples": 2,
        "estimate_memory_new_tokens": 4,
        "estimate_memory_new_token_samples": 2,
        "max_batch_size": 16,
    }
    limits = ServingLimits(max_sequence_length=256, max_new_tokens=100)
    with caplog.at_level(logging.INFO, logger="tgis.startup.memory"):
        weights = memory.estimate(settings(**values), gpt2_engine, limits)
    assert isinstance(weights, PaddedWeights)
    assert gpt2_engine.num_rows == 0
    assert "longest single request that fits" in caplog.text
    coefficients = weights.coefficients
    assert min(coefficients.a, coefficients.b, coefficients.c, coefficients.d, coefficients.e) >= 0
    assert max(coefficients.a, coefficients.c) > 0 and max(coefficients.d, coefficients.e) > 0
    # Wmax is the budget less the margin, applied once.
    assert weights.max_weight == math.floor(0.8 * budget_mb * MIB)
    # Monotone: a bigger batch (more rows, longer rows, more output) never weighs less.
    for small, big in [((2, 50, 4), (3, 50, 4)), ((2, 50, 4), (2, 60, 4)), ((2, 50, 4), (2, 50, 9))]:
        small_batch = [SequenceShape(small[1], small[2])] * small[0]
        big_batch = [SequenceShape(big[1], big[2])] * big[0]
        assert weights.worst(small_batch) < weights.worst(big_batch)
        assert weights.prefill(small_batch) <= weights.prefill(big_batch)
    assert weights.prefill([SequenceShape(50, 1)] * 3) > weights.prefill([SequenceShape(50, 1)] * 2)
    # What the weights admit really runs within the budget (the margin covers the fit error).
    size, length = max(warmup_shapes(weights, 256, 16), key=lambda s: s[0] * s[1])
    assert peak_of(gpt2_engine, size, length) <= budget_mb * MIB
