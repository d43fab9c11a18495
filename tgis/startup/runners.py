"""The batch runner a loaded engine calls for, calibrated at start: the padded runner's memory model
(SPEC §6.5) or the paged runner's KV pool, the fit check, and compilation warm-up under PT2_COMPILE."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import cast

from engines.base import Engine
from engines.compiled import warm_up, warm_up_steps
from engines.speculative.mlp import MLPSpeculator
from engines.step import PagedEngine
from tgis.adapters.loading import model_hidden_size
from tgis.batching.admission import Admission
from tgis.batching.batch_weights import warmup_shapes
from tgis.batching.blocks import BlockPool
from tgis.batching.paged import PagedPlanner
from tgis.config import ServingLimits, Settings, model_max_sequence_length
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.padded_runner import PaddedRunner
from tgis.engine_loop.paged_runner import PagedRunner
from tgis.engine_loop.speculation import MLPProposer, NgramProposer, Speculation
from tgis.openmp import short_gil_switch
from tgis.speculation.gate import BatchGate
from tgis.speculation.ngram import MAX_NGRAM, MIN_NGRAM, SINGLE_TOKEN_DRAFT
from tgis.startup import kv_pool, memory
from tgis.startup.fit import check_max_length_fits
from tgis.startup.model import LoadedModel

logger = logging.getLogger(__name__)

# Tokens prompt lookup proposes per step at most, unless SPECULATOR_TOKENS says otherwise. A sequence's
# drafts shorten after a rejection (SequenceGate), so a long limit costs little where drafts fail; 8
# against 4 measured docs/benchmark/speculation-defaults/.
NGRAM_TOKENS = 8


def build_runner(
    settings: Settings,
    model: LoadedModel,
    limits: ServingLimits,
    metrics: LoopMetrics,
    eos: Sequence[int],
    *,
    probe_ids: Sequence[int],
    with_prefixes: bool,
) -> PagedRunner | PaddedRunner:
    """`probe_ids`: the health probe's prompt, whose blocks the paged pool keeps out of admission's
    reach; `with_prefixes`: compile warm-up covers prompt-tuning prefixes too."""
    hidden = model_hidden_size(model.engine.spec.model_config) if with_prefixes else None
    if model.engine.spec.paged:
        engine = cast(PagedEngine, model.engine)
        return _paged_runner(settings, engine, limits, metrics, eos, len(probe_ids), hidden, model.speculator)
    return _padded_runner(settings, cast(Engine, model.engine), limits, metrics, eos, hidden)


def warm_up_length(limits: ServingLimits, engine: Engine | PagedEngine) -> int:
    """The longest sequence PT2_COMPILE's warm-up may run: the served limit, but never past the model's
    own positions, which MAX_SEQUENCE_LENGTH may exceed (SPEC §9.2 only warns): a longer warm-up step
    would fail the startup in the model's position table."""
    return min(limits.max_sequence_length, model_max_sequence_length(engine.spec.model_config))


def _padded_runner(
    settings: Settings,
    engine: Engine,
    limits: ServingLimits,
    metrics: LoopMetrics,
    eos: Sequence[int],
    prefix_hidden_size: int | None,
) -> PaddedRunner:
    weights = memory.estimate(settings, engine, limits)  # SPEC §9.4: after the load
    check_max_length_fits(weights, limits.max_sequence_length)
    if settings.pt2_compile:  # SPEC §7: compile every shape the weights admit before serving
        shapes = warmup_shapes(weights, warm_up_length(limits, engine), settings.max_batch_size)
        warm_up(engine, [*shapes, (1, 1), (2, 2)], prefix_hidden_size=prefix_hidden_size)
    admission = Admission(settings.max_batch_size, settings.max_waiting_tokens, weights)
    return PaddedRunner(engine, admission, eos, metrics)


def _paged_runner(
    settings: Settings,
    engine: PagedEngine,
    limits: ServingLimits,
    metrics: LoopMetrics,
    eos: Sequence[int],
    probe_tokens: int,
    prefix_hidden_size: int | None,
    speculator: MLPSpeculator | None,
) -> PagedRunner:
    """The paged step: a KV pool sized once from the memory, admission counted in its blocks."""
    pool_size = kv_pool.size_pool(settings, engine, limits)
    reserved = -(-probe_tokens // pool_size.block_size)
    weights = kv_pool.admission_weights(settings, pool_size, reserved)
    check_max_length_fits(weights, limits.max_sequence_length)
    engine.allocate(pool_size.num_blocks, pool_size.block_size)
    if settings.pt2_compile:  # compile every graph serving uses before serving
        warm_up_steps(
            engine,
            settings.max_step_tokens,
            pool_size.block_size,
            pool_size.num_blocks,
            max_sequence_length=warm_up_length(limits, engine),
            prefix_hidden_size=prefix_hidden_size,
        )
        if engine.spec.whole_graph_steps:
            _export_fused_steps(engine)
            short_gil_switch()
    _log_pool(settings, engine, pool_size, limits)
    metrics.attention(engine.attention_path, engine.attention_fallback)
    if kv_pool.uses_decode_graphs(settings, engine.spec):
        _capture_decode_graphs(engine, limits, settings.max_batch_size)
    metrics.graphs_captured(engine.graphs_captured)
    pool = BlockPool(pool_size.num_blocks, pool_size.block_size, prefix_caching=settings.prefix_caching)
    admission = Admission(settings.max_batch_size, settings.max_waiting_tokens, weights)
    planner = PagedPlanner(pool, settings.max_step_tokens)
    return PagedRunner(
        engine, admission, planner, eos, metrics, speculation=speculation(settings, speculator)
    )


def speculation(settings: Settings, speculator: MLPSpeculator | None) -> Speculation | None:
    """The speculation SPECULATOR_NAME asks for (None without one), logged as it is set up."""
    name = settings.speculator_name
    if not name:
        return None
    gate = BatchGate(settings.speculator_max_batch_size)
    proposer: NgramProposer | MLPProposer
    if speculator is None:
        proposer, tokens = NgramProposer(), settings.speculator_tokens or NGRAM_TOKENS
        how = (
            f"prompt lookup (tails of {MAX_NGRAM} tokens down to {MIN_NGRAM}; a single token's draft at most "
            f"{SINGLE_TOKEN_DRAFT})"
        )
    else:
        n_predict = speculator.config.n_predict
        proposer, tokens = MLPProposer(speculator), min(settings.speculator_tokens or n_predict, n_predict)
        how = f"the MLP speculator {name} ({n_predict} heads, fed the model's last hidden state)"
    logger.info(
        f"Speculative decoding: {how}, up to {tokens} tokens per sequence and step, while at most "
        f"{gate.max_batch_size} sequences decode and where it measures cheaper per token than plain "
        "decoding; greedy output and seeded samples are unchanged by it"
    )
    return Speculation(proposer, tokens, gate)


def _capture_decode_graphs(engine: PagedEngine, limits: ServingLimits, max_batch: int) -> None:
    started = time.monotonic()
    reason = engine.capture_decode_graphs(limits.max_sequence_length, max_batch)
    if reason is None:
        seconds = time.monotonic() - started
        logger.info(f"CUDA graphs of decode steps up to {max_batch} sequences captured in {seconds:.1f} s")
    else:
        logger.warning(f"Decode steps run without CUDA graphs: {reason}")


def _export_fused_steps(engine: PagedEngine) -> None:
    started = time.monotonic()
    reason = engine.export_fused_steps()
    if reason is None:
        seconds = time.monotonic() - started
        logger.info(f"PT2_COMPILE: decode steps run from an AOTInductor package, exported in {seconds:.1f} s")
    else:
        logger.warning(f"PT2_COMPILE: decode steps stay with torch.compile: {reason}")


def _log_pool(
    settings: Settings, engine: PagedEngine, pool_size: kv_pool.PoolSize, limits: ServingLimits
) -> None:
    per_block = engine.kv_shape.bytes_per_block(pool_size.block_size)
    logger.info(
        f"Paged KV cache: {pool_size.num_blocks} blocks of {pool_size.block_size} positions "
        f"({pool_size.num_blocks * per_block / kv_pool.MIB:.0f} MiB, from {pool_size.source}); "
        f"up to {settings.max_step_tokens} tokens per step; prefix caching "
        f"{'on' if settings.prefix_caching else 'off'}; one step may use about "
        f"{kv_pool.step_overhead_bytes(settings, engine, limits) / kv_pool.MIB:.0f} MiB beyond the pool"
    )
    if settings.estimate_memory != "auto":
        logger.warning(f"ESTIMATE_MEMORY={settings.estimate_memory} has no effect on the paged step")
