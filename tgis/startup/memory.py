"""The memory model behind admission: ESTIMATE_MEMORY off / manual / auto → batch weights (SPEC §6.5).

The safety margin is applied once (project decision 9): Wmax = ⌊P·free⌋ with P = (100 − margin)/100,
and the coefficients describe the memory a token really takes. TGIS's manual mode also divides the
coefficients by P, so there the margin is taken twice (capacity P²·L·B tokens, 64 % by default).
"""

from __future__ import annotations

import gc
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from engines.base import Engine, PrefillRow
from tgis.batching.admission import BatchWeights, Unlimited
from tgis.batching.batch_weights import MemoryCoefficients, longest_request, weights_for
from tgis.config import ServingLimits, Settings, StartupError
from tgis.startup.memory_probe import LiveTensorPeak, MemoryBudgetExceeded

logger = logging.getLogger(__name__)

MIB = 1 << 20
MANUAL_FREE_MEMORY = 100  # manual mode's memory unit: 100 = all the memory B requests of L tokens take
SEARCH_RESOLUTION = 10  # the binary search for the longest prefill stops below this interval
MIN_PREFILL_FIT_POINTS = 4  # prefill lengths measured for the fits: this many, or 2 × MIN_SAMPLES
DECODE_LENGTH_FRACTION = 0.75  # decode samples use inputs below this fraction of the longest prefill
SEED = 0


def usable_fraction(batch_safety_margin: int) -> float:
    """P = (100 − BATCH_SAFETY_MARGIN)/100: the part of the free memory batches may use."""
    return (100 - batch_safety_margin) / 100


def max_weight(free_memory: float, batch_safety_margin: int) -> int:
    """Wmax = ⌊P·free_memory⌋."""
    return math.floor(usable_fraction(batch_safety_margin) * free_memory)


def manual_coefficients(max_sequence_length: int, max_batch_size: int, *, padded: bool) -> MemoryCoefficients:
    """ESTIMATE_MEMORY=manual: B requests of L tokens take all of the MANUAL_FREE_MEMORY (100).

    Padded: c = 100/(L²·B), a = b = 0, d = e = 100/(L·B); unpadded: a = d = e = 100/(L·B). With
    Wmax = ⌊P·100⌋ the batch holds about P·L·B tokens (80 % of L·B at the default margin of 20), so
    with that margin MAX_BATCH_SIZE = 1 cannot hold one request of L tokens and startup fails.
    TGIS divides every coefficient by P as well (margin taken twice: P²·L·B tokens); this server
    applies the margin once.
    """
    per_token = MANUAL_FREE_MEMORY / (max_sequence_length * max_batch_size)
    if padded:
        quadratic = MANUAL_FREE_MEMORY / (max_sequence_length**2 * max_batch_size)
        return MemoryCoefficients(a=0.0, b=0.0, c=quadratic, d=per_token, e=per_token)
    return MemoryCoefficients(a=per_token, b=0.0, c=0.0, d=per_token, e=per_token)


def estimate(
    settings: Settings, engine: Engine, limits: ServingLimits, *, padded: bool = True
) -> BatchWeights:
    """The batch weights admission uses, per ESTIMATE_MEMORY (PT2_COMPILE forces `auto`).

    `auto` runs synthetic batches on the loaded engine (and leaves it empty); on CPU it needs
    CPU_MEMORY_BUDGET_MB, and without it there is no memory limit. Raises StartupError when not even
    the shortest probe fits.
    """
    mode = settings.estimate_memory
    if settings.pt2_compile and mode != "auto":
        logger.info(f"PT2_COMPILE needs a measured memory model: ESTIMATE_MEMORY={mode} becomes auto")
        mode = "auto"
    if mode == "off":
        logger.info("ESTIMATE_MEMORY=off: no memory limit, only MAX_BATCH_SIZE bounds the batch")
        return Unlimited()
    margin = settings.batch_safety_margin
    if mode == "manual":
        coefficients = manual_coefficients(limits.max_sequence_length, settings.max_batch_size, padded=padded)
        weights = weights_for(
            coefficients, max_weight(MANUAL_FREE_MEMORY, margin), settings.max_prefill_padding, padded=padded
        )
        _log_model("manual", weights, coefficients, limits)
        return weights
    meter = _meter_for(settings, engine)
    if meter is None:
        logger.info(
            "ESTIMATE_MEMORY=auto on CPU without CPU_MEMORY_BUDGET_MB: no memory limit, "
            "only MAX_BATCH_SIZE bounds the batch"
        )
        return Unlimited()
    coefficients = Estimator(engine, meter, EstimatorConfig.from_settings(settings, limits)).fit()
    if not any(vars(coefficients).values()):
        logger.warning(
            "Memory estimation saw no memory use (does the engine allocate outside torch?): "
            "no memory limit, only MAX_BATCH_SIZE bounds the batch"
        )
        return Unlimited()
    weights = weights_for(
        coefficients, max_weight(meter.free_bytes, margin), settings.max_prefill_padding, padded=padded
    )
    _log_model(f"auto ({meter.free_bytes / MIB:.1f} MiB free)", weights, coefficients, limits)
    return weights


def _log_model(
    mode: str, weights: BatchWeights, coefficients: MemoryCoefficients, limits: ServingLimits
) -> None:
    c = coefficients
    logger.info(
        f"Memory model {mode}: a={c.a:.6g} b={c.b:.6g} c={c.c:.6g} d={c.d:.6g} e={c.e:.6g}, "
        f"Wmax={weights.max_weight}; the longest single request that fits has "
        f"{longest_request(weights, limits.max_sequence_length)} tokens"
    )


# ---------------------------------------------------------------- measuring


class Meter(Protocol):
    """Peak memory of what the engine allocates, in bytes above what was live when it was made."""

    free_bytes: int  # what batches may use at most; a peak above it counts as out of memory

    def tracking(self) -> AbstractContextManager[None]:
        """Count allocations while inside (CPU probes count nothing outside)."""
        ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...


class CudaMeter:
    """torch.cuda's allocator statistics; free = the device's free memory (and the allocator's
    cached blocks) after loading, less `reserved_bytes` (the prompt cache)."""

    def __init__(self, device: torch.device, reserved_bytes: int = 0, process_fraction: float = 1.0) -> None:
        self.device = device
        _release_cached(device)
        self.baseline = torch.cuda.memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - self.baseline
        if process_fraction < 1.0:
            free = min(free, int(process_fraction * total) - self.baseline)
        self.free_bytes = max(0, free - reserved_bytes)

    @contextmanager
    def tracking(self) -> Iterator[None]:
        yield

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.baseline)


class CpuMeter:
    """Live tensor bytes counted by a dispatch-mode probe; free = the configured budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.free_bytes = budget_bytes
        self._probe: LiveTensorPeak | None = None

    @contextmanager
    def tracking(self) -> Iterator[None]:
        probe = LiveTensorPeak(budget=self.free_bytes)
        self._probe = probe
        try:
            with probe:
                yield
        finally:
            self._probe = None

    def reset_peak(self) -> None:
        if self._probe is not None:
            self._probe.reset_peak()

    def peak(self) -> int:
        return 0 if self._probe is None else self._probe.peak


def _meter_for(settings: Settings, engine: Engine) -> CudaMeter | CpuMeter | None:
    device = engine.spec.device
    if device.type == "cuda":
        reserved = settings.prompt_cache_size_mb * MIB if settings.prefix_store_path else 0
        return CudaMeter(device, reserved, settings.cuda_process_memory_fraction)
    if settings.cpu_memory_budget_mb is None:
        return None
    return CpuMeter(settings.cpu_memory_budget_mb * MIB)


def _release_cached(device: torch.device) -> None:
    """Give the CUDA allocator's cached blocks back, so that free memory and peaks start clean
    (on CPU, dropping the references already freed the tensors)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryBudgetExceeded)


# ---------------------------------------------------------------- fitting


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
            _release_cached(self.engine.spec.device)
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
            _release_cached(self.engine.spec.device)
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

    def fit_prefill(self, bound: int) -> tuple[float, float, float]:
        """a through the range where peak ∝ tokens (within FIT_THRESHOLD); b, c over the points past
        the first one that breaks linearity (at least MIN_SAMPLES of them)."""
        cfg = self.config
        low = min(cfg.start_seq_len, bound)
        points = max(MIN_PREFILL_FIT_POINTS, 2 * cfg.min_samples)
        grid = [round(low + (bound - low) * i / (points - 1)) for i in range(points)]
        known = [length for length, sample in self._samples.items() if sample is not None]
        samples = self._fitted([*grid, *known])
        xs = [float(s.tokens) for s in samples]
        ys = [float(s.peak) for s in samples]
        linear = 1
        a = ys[0] / xs[0]
        for count in range(2, len(samples) + 1):
            (slope,) = nonnegative_least_squares([[x] for x in xs[:count]], ys[:count])
            if _max_relative_error(slope, xs[:count], ys[:count]) > cfg.fit_threshold:
                break
            linear, a = count, slope
        if linear == len(samples):
            logger.info(
                f"Memory estimation: prefill memory stays linear up to {bound} tokens per row, "
                f"so there is no quadratic term (b = c = 0)"
            )
            return a, 0.0, 0.0
        beyond = samples[linear:]
        if len(beyond) < cfg.min_samples:
            start = samples[linear - 1].length
            wanted = cfg.min_samples
            extra = [round(start + (bound - start) * (i + 1) / wanted) for i in range(wanted)]
            beyond = [s for s in self._fitted([*(s.length for s in beyond), *extra]) if s.length > start]
        b, c = nonnegative_least_squares(
            [[float(s.tokens), float(s.tokens) * s.length] for s in beyond], [float(s.peak) for s in beyond]
        )
        logger.info(
            f"Memory estimation: prefill memory is linear up to {samples[linear - 1].length} tokens per row; "
            f"quadratic fit over {len(beyond)} lengths up to {bound}"
        )
        return a, b, c

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
