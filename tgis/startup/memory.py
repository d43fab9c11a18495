"""The memory model behind admission: ESTIMATE_MEMORY off / manual / auto → batch weights (SPEC §6.5).

The safety margin is applied once (project decision 9): Wmax = ⌊P·free⌋ with P = (100 − margin)/100,
and the coefficients describe the memory a token really takes. TGIS's manual mode also divides the
coefficients by P, so there the margin is taken twice (capacity P²·L·B tokens, 64 % by default).
`auto` measures with tgis.startup.memory_meters and fits with tgis.startup.memory_estimator.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

from engines.base import Engine
from tgis.batching.admission import BatchWeights, Unlimited
from tgis.batching.batch_weights import MemoryCoefficients, longest_request, weights_for
from tgis.config import ServingLimits, Settings
from tgis.startup.memory_estimator import Estimator, EstimatorConfig
from tgis.startup.memory_meters import MIB, meter_for

logger = logging.getLogger(__name__)

MANUAL_FREE_MEMORY = 100  # manual mode's memory unit: 100 = all the memory B requests of L tokens take


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
    mode = _mode(settings)
    if mode == "off":
        logger.info("ESTIMATE_MEMORY=off: no memory limit, only MAX_BATCH_SIZE bounds the batch")
        return Unlimited()
    if mode == "manual":
        return _manual_weights(settings, limits, padded)
    return _auto_weights(settings, engine, limits, padded)


def _mode(settings: Settings) -> Literal["auto", "manual", "off"]:
    """ESTIMATE_MEMORY, or `auto` where PT2_COMPILE needs a measured memory model."""
    mode = settings.estimate_memory
    if settings.pt2_compile and mode != "auto":
        logger.info(f"PT2_COMPILE needs a measured memory model: ESTIMATE_MEMORY={mode} becomes auto")
        return "auto"
    return mode


def _manual_weights(settings: Settings, limits: ServingLimits, padded: bool) -> BatchWeights:
    coefficients = manual_coefficients(limits.max_sequence_length, settings.max_batch_size, padded=padded)
    weights = weights_for(
        coefficients,
        max_weight(MANUAL_FREE_MEMORY, settings.batch_safety_margin),
        settings.max_prefill_padding,
        padded=padded,
    )
    _log_model("manual", weights, coefficients, limits)
    return weights


def _auto_weights(settings: Settings, engine: Engine, limits: ServingLimits, padded: bool) -> BatchWeights:
    meter = meter_for(settings, engine)
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
        coefficients,
        max_weight(meter.free_bytes, settings.batch_safety_margin),
        settings.max_prefill_padding,
        padded=padded,
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
