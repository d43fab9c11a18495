"""ESTIMATE_MEMORY=auto's estimator: synthetic batches on the loaded engine, fitted to the coefficients
a–e by nonnegative least squares (SPEC §6.5)."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engines.base import Engine, PrefillRow
from tgis.batching.batch_weights import MemoryCoefficients
from tgis.config import ServingLimits, Settings, StartupError
from tgis.startup.memory_meters import OUT_OF_MEMORY, Meter, release_cached

# The estimator's lines are the memory model's: they keep its logger name.
logger = logging.getLogger("tgis.startup.memory")

SEARCH_RESOLUTION = 10  # the binary search for the longest prefill stops below this interval
MIN_PREFILL_FIT_POINTS = 4  # prefill lengths measured for the fits: this many, or 2 × MIN_SAMPLES
DECODE_LENGTH_FRACTION = 0.75  # decode samples use inputs below this fraction of the longest prefill
SEED = 0


def nonnegative_least_squares(features: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """argmin ‖F·x − y‖ subject to x ≥ 0, for a handful of unknowns: the optimum is the unconstrained
    solution on some subset of the columns, so try every subset and keep the best feasible one."""
    columns = len(features[0])
    matrix = torch.tensor(features, dtype=torch.float64)
    target = torch.tensor(targets, dtype=torch.float64)[:, None]
    scale = matrix.abs().amax(dim=0).clamp(min=1e-300)  # equilibrate: token counts vs tokens²
    scaled = matrix / scale
    best = [0.0] * columns
    best_residual = float(target.norm())
    for subset in range(1, 1 << columns):
        chosen = [j for j in range(columns) if subset >> j & 1]
        solution = torch.linalg.lstsq(scaled[:, chosen], target).solution[:, 0]
        if bool((solution < 0).any()):
            continue
        residual = float((scaled[:, chosen] @ solution[:, None] - target).norm())
        if residual < best_residual:
            best_residual = residual
            best = [0.0] * columns
            for j, value in zip(chosen, solution.tolist(), strict=True):
                best[j] = value / float(scale[j])
    return best


def _max_relative_error(coefficient: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    return max(abs(coefficient * x - y) / max(y, 1.0) for x, y in zip(xs, ys, strict=True))


@dataclass(frozen=True)
class EstimatorConfig:
    batch_size: int
    min_samples: int
    start_seq_len: int
    stop_seq_len: int
    fit_threshold: float
    new_tokens: int
    new_token_samples: int
    max_sequence_length: int

    @classmethod
    def from_settings(cls, settings: Settings, limits: ServingLimits) -> EstimatorConfig:
        return cls(
            batch_size=settings.estimate_memory_batch_size,
            min_samples=settings.estimate_memory_min_samples,
            start_seq_len=settings.estimate_memory_start_seq_len,
            stop_seq_len=settings.estimate_memory_stop_seq_len,
            fit_threshold=settings.estimate_memory_fit_threshold,
            new_tokens=settings.estimate_memory_new_tokens,
            new_token_samples=settings.estimate_memory_new_token_samples,
            max_sequence_length=limits.max_sequence_length,
        )


@dataclass(frozen=True)
class PrefillSample:
    length: int
    tokens: int  # batch size × length
    peak: int


class Estimator:
    """Fits the coefficients a–e on synthetic batches of random token ids (SPEC §6.5 `auto`)."""

    def __init__(self, engine: Engine, meter: Meter, config: EstimatorConfig) -> None:
        self.engine = engine
        self.meter = meter
        self.config = config
        self._rng = random.Random(SEED)
        self._samples: dict[int, PrefillSample | None] = {}  # length → sample (None: out of memory)

    def fit(self) -> MemoryCoefficients:
        self.engine.clear()
        try:
            bound = self.longest_prefill()
            a, b, c = self.fit_prefill(bound)
            d, e = self.fit_next_token(bound)
        finally:
            self.engine.clear()
            release_cached(self.engine.spec.device)
        return MemoryCoefficients(a=a, b=b, c=c, d=d, e=e)

    # ---- measurements

    def _rows(self, batch_size: int, length: int) -> list[PrefillRow]:
        vocab = self.engine.spec.vocab_size
        return [PrefillRow([self._rng.randrange(vocab) for _ in range(length)]) for _ in range(batch_size)]

    def _measure(self, run: Callable[[], object]) -> int | None:
        """Peak bytes of `run` on an empty engine, or None if it ran out of memory."""
        self.engine.clear()
        try:
            with self.meter.tracking():
                self.meter.reset_peak()
                run()
                peak = self.meter.peak()
        except OUT_OF_MEMORY:
            peak = None
        finally:
            self.engine.clear()
            release_cached(self.engine.spec.device)
        return None if peak is None or peak > self.meter.free_bytes else peak

    def prefill_sample(self, length: int) -> PrefillSample | None:
        if length not in self._samples:
            rows = self._rows(self.config.batch_size, length)
            peak = self._measure(lambda: self.engine.prefill(rows))
            tokens = self.config.batch_size * length
            self._samples[length] = None if peak is None else PrefillSample(length, tokens, peak)
        return self._samples[length]

    def longest_prefill(self) -> int:
        """Binary search of the longest prefill of `batch_size` rows that fits, within
        [START_SEQ_LEN, STOP_SEQ_LEN] (both capped by the max sequence length)."""
        cfg = self.config
        high = min(cfg.stop_seq_len, cfg.max_sequence_length)
        low = min(cfg.start_seq_len, high)
        if self.prefill_sample(low) is None:
            raise StartupError(
                f"Memory estimation: a batch of {cfg.batch_size} sequences of {low} tokens does not fit "
                f"in memory; lower ESTIMATE_MEMORY_BATCH_SIZE or ESTIMATE_MEMORY_START_SEQ_LEN"
            )
        if self.prefill_sample(high) is not None:
            return high
        while high - low >= SEARCH_RESOLUTION:
            middle = (low + high) // 2
            if self.prefill_sample(middle) is None:
                high = middle
            else:
                low = middle
        return low

    def _fitted(self, lengths: Sequence[int]) -> list[PrefillSample]:
        samples = (self.prefill_sample(length) for length in sorted(set(lengths)))
        return [sample for sample in samples if sample is not None]

    # ---- fits

    def fit_prefill(self, bound: int) -> tuple[float, float, float]:
        """a through the range where peak ∝ tokens (within FIT_THRESHOLD); b, c over the points past
        the first one that breaks linearity (at least MIN_SAMPLES of them)."""
        cfg = self.config
        low = min(cfg.start_seq_len, bound)
        points = max(MIN_PREFILL_FIT_POINTS, 2 * cfg.min_samples)
        grid = [round(low + (bound - low) * i / (points - 1)) for i in range(points)]
        known = [length for length, sample in self._samples.items() if sample is not None]
        samples = self._fitted([*grid, *known])
        linear, a = self._linear_range(samples)
        if linear == len(samples):
            logger.info(
                f"Memory estimation: prefill memory stays linear up to {bound} tokens per row, "
                f"so there is no quadratic term (b = c = 0)"
            )
            return a, 0.0, 0.0
        beyond = self._samples_past(samples, linear, bound)
        b, c = nonnegative_least_squares(
            [[float(s.tokens), float(s.tokens) * s.length] for s in beyond], [float(s.peak) for s in beyond]
        )
        logger.info(
            f"Memory estimation: prefill memory is linear up to {samples[linear - 1].length} tokens per row; "
            f"quadratic fit over {len(beyond)} lengths up to {bound}"
        )
        return a, b, c

    def _linear_range(self, samples: Sequence[PrefillSample]) -> tuple[int, float]:
        """How many of the shortest samples have peak ∝ tokens within FIT_THRESHOLD, and that slope."""
        xs = [float(s.tokens) for s in samples]
        ys = [float(s.peak) for s in samples]
        linear = 1
        slope = ys[0] / xs[0]
        for count in range(2, len(samples) + 1):
            (fitted,) = nonnegative_least_squares([[x] for x in xs[:count]], ys[:count])
            if _max_relative_error(fitted, xs[:count], ys[:count]) > self.config.fit_threshold:
                break
            linear, slope = count, fitted
        return linear, slope

    def _samples_past(self, samples: list[PrefillSample], linear: int, bound: int) -> list[PrefillSample]:
        """The samples past the first `linear` ones, topped up with lengths up to `bound` to at least
        MIN_SAMPLES."""
        beyond = samples[linear:]
        wanted = self.config.min_samples
        if len(beyond) >= wanted:
            return beyond
        start = samples[linear - 1].length
        extra = [round(start + (bound - start) * (i + 1) / wanted) for i in range(wanted)]
        return [s for s in self._fitted([*(s.length for s in beyond), *extra]) if s.length > start]

    def fit_next_token(self, bound: int) -> tuple[float, float]:
        """d, e from NEW_TOKENS decode steps after prefills at NEW_TOKEN_SAMPLES input lengths below
        75 % of the longest prefill: peak ≈ d·(rows·input) + e·(rows·generated)."""
        cfg = self.config
        top = max(1, math.ceil(DECODE_LENGTH_FRACTION * bound) - 1)
        count = cfg.new_token_samples
        lengths = sorted({max(1, top * (i + 1) // count) for i in range(count)})
        features: list[list[float]] = []
        peaks: list[float] = []
        for length in lengths:
            steps = min(cfg.new_tokens, cfg.max_sequence_length - length)
            for generated, peak in self._decode_peaks(length, steps):
                features.append([float(cfg.batch_size * length), float(cfg.batch_size * generated)])
                peaks.append(float(peak))
        if not peaks:
            raise StartupError("Memory estimation: no next-token step fits in memory")
        d, e = nonnegative_least_squares(features, peaks)
        return d, e

    def _decode_peaks(self, length: int, steps: int) -> list[tuple[int, int]]:
        """(tokens generated, peak bytes) for each decode step after one prefill; stops at the first
        step that runs out of memory."""
        rows = self._rows(self.config.batch_size, length)
        peaks: list[tuple[int, int]] = []

        def run() -> None:
            self.engine.prefill(rows)
            tokens = [row.input_ids[-1] for row in rows]
            for generated in range(1, steps + 1):
                self.meter.reset_peak()
                self.engine.decode(tokens)
                peak = self.meter.peak()
                if peak > self.meter.free_bytes:
                    return
                peaks.append((generated, peak))

        self._measure(run)
        return peaks
