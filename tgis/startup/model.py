"""Loading what a server serves: the model (or the demo model) with its engine and tokenizer, and the
adapter store."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engines.base import Engine, EngineConfig, EngineSpec
from engines.registry import load_engine
from engines.speculative.checkpoint import load_mlp_speculator
from engines.speculative.mlp import MLPSpeculator
from engines.step import PagedEngine
from tgis.adapters.loading import model_hidden_size
from tgis.adapters.store import AdapterStore
from tgis.config import ServingLimits, Settings, max_prefix_length, shard_count
from tgis.errors import StartupError
from tgis.hub import resolve_model_path
from tgis.metrics import Metrics
from tgis.model_choice import log_demo_choice, wants_demo_model
from tgis.model_files.cache_dir import hub_cache_dir
from tgis.quantization import quantization_at_load
from tgis.startup.cuda_memory import cap_cuda_memory, set_tf32
from tgis.startup.generation_defaults import sampling_defaults
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import SamplingDefaults

logger = logging.getLogger(__name__)


NGRAM = "ngram"  # SPECULATOR_NAME for prompt lookup, which needs no speculator model
DEMO = "demo"  # SPECULATOR_NAME for the demo model's speculator, trained at first use


@dataclass(frozen=True)
class LoadedModel:
    path: Path
    engine: Engine | PagedEngine  # spec.paged tells which
    tokenizer: Tokenizer
    speculator: MLPSpeculator | None = None  # SPECULATOR_NAME's MLP speculator, on the model's device
    # generation_config.json's sampling values, the OpenAI routes' defaults (GENERATION_CONFIG=auto)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


def load_model(settings: Settings, environ: Mapping[str, str]) -> LoadedModel:
    """Resolve the model offline (or build the demo model), then load engine and tokenizer."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the weight-loading bar: no progress bars in a server log
    path = _model_path(settings, environ)
    quantize = quantization_at_load(
        settings.quantize,
        dtype_name=settings.dtype_name,
        framework=settings.deployment_framework,
        model_config=json.loads((path / "config.json").read_text()),
        pt2_compile=settings.pt2_compile,
    )
    engine = load_engine(settings.deployment_framework, _engine_config(settings, environ, path, quantize))
    cap_cuda_memory(settings.cuda_process_memory_fraction, engine.spec.device)
    set_tf32(settings.allow_tf32, engine.spec.device)
    tokenizer = Tokenizer.load(
        path,
        trust_remote_code=settings.trust_remote_code,
        output_special_tokens=settings.output_special_tokens,
    )
    return LoadedModel(
        path,
        engine,
        tokenizer,
        _speculator(settings, environ, engine.spec),
        sampling_defaults(path, settings.generation_config),
    )


def _speculator(settings: Settings, environ: Mapping[str, str], spec: EngineSpec) -> MLPSpeculator | None:
    """The MLP speculator SPECULATOR_NAME names (a directory or a hub id in the cache, or `demo`),
    checked against the model it serves."""
    name = settings.speculator_name
    if name and not spec.paged:  # before a speculator is loaded, or trained for the demo model
        raise StartupError(
            f"SPECULATOR_NAME={name} needs the paged step, and this model runs padded batches (see the "
            "log line on the paged step above)"
        )
    if not name or name == NGRAM:
        return None
    if name == DEMO:
        from tgis.demo_speculator import ensure_demo_speculator

        path = ensure_demo_speculator()
    else:
        revision = settings.speculator_revision or "main"
        path = resolve_model_path(name, revision=revision, cache_dir=hub_cache_dir(environ))
    try:
        speculator = load_mlp_speculator(path, device=spec.device, dtype=spec.dtype)
    except (OSError, ValueError) as exc:
        raise StartupError(f"SPECULATOR_NAME={name}: {exc}") from exc
    _check_candidate_settings(settings, speculator)
    hidden, vocab = model_hidden_size(spec.model_config), spec.vocab_size
    if speculator.config.emb_dim != hidden or speculator.config.vocab_size > vocab:
        raise StartupError(
            f"SPECULATOR_NAME={name} was trained for hidden size {speculator.config.emb_dim} and "
            f"{speculator.config.vocab_size} tokens; this model has {hidden} and {vocab}"
        )
    return speculator


def _check_candidate_settings(settings: Settings, speculator: MLPSpeculator) -> None:
    """SPECULATOR_TOP_K_TOKENS_PER_HEAD is checked as TGIS checks it (one count per head), and said to
    have no effect: it shapes the extra candidate chains, and one chain is verified here. A checkpoint
    whose config asks for several candidates (TGIS's default for SPECULATOR_N_CANDIDATES) is told so."""
    n_predict = speculator.config.n_predict
    per_head = settings.speculator_top_k_tokens_per_head
    if per_head is not None:
        try:
            counts = [int(part) for part in per_head.strip().split(",")]
        except ValueError as exc:
            raise StartupError(f"SPECULATOR_TOP_K_TOKENS_PER_HEAD={per_head}: {exc}") from exc
        if len(counts) != n_predict:
            raise StartupError(
                f"Length of top_k_tokens_per_head ({counts}) does not match speculator.config.n_predict "
                f"({n_predict})"
            )
        logger.warning(
            f"SPECULATOR_TOP_K_TOKENS_PER_HEAD={per_head} has no effect: it builds the extra candidate "
            "chains, and this server verifies one chain per sequence (SPECULATOR_N_CANDIDATES=1)"
        )
    if settings.speculator_n_candidates is None and speculator.config.n_candidates > 1:
        logger.info(
            f"The speculator's config asks for {speculator.config.n_candidates} candidate chains (TGIS's "
            "default for SPECULATOR_N_CANDIDATES); this server verifies the best one per sequence"
        )


def _model_path(settings: Settings, environ: Mapping[str, str]) -> Path:
    if wants_demo_model(settings, environ):
        from tgis.demo_model import ensure_demo_model

        path = ensure_demo_model()
        log_demo_choice(settings, environ, path)
        return path
    assert settings.model_name is not None
    return resolve_model_path(
        settings.model_name, revision=settings.revision, cache_dir=hub_cache_dir(environ)
    )


def _engine_config(
    settings: Settings, environ: Mapping[str, str], path: Path, quantize: str | None = None
) -> EngineConfig:
    return EngineConfig(
        model_path=path,
        dtype=None if settings.dtype_name == "int8" else settings.dtype_name,  # TGIS's int8: QUANTIZE
        quantize=quantize,
        quantize_group_size=settings.quantize_group_size,
        trust_remote_code=settings.trust_remote_code,
        attn_implementation=settings.transformers_attn_impl,
        num_shards=shard_count(settings, environ),
        master_addr=settings.master_addr,
        master_port=settings.master_port,
        compile=settings.pt2_compile,
        paged=settings.paged_step,
        cpu_bf16=True,  # DTYPE unset on a CPU with native bf16: bfloat16 (logged)
        kv_block_size=settings.kv_block_size,
    )


def adapter_store(
    settings: Settings, spec: EngineSpec, limits: ServingLimits, metrics: Metrics
) -> AdapterStore | None:
    """The prefix/adapter store of SPEC §8, when PREFIX_STORE_PATH (or ADAPTER_CACHE) is set."""
    limit = max_prefix_length(settings, limits.max_sequence_length)  # checked even without a store
    if settings.prefix_store_path is None and not settings.allow_runtime_lora_updating:
        return None
    root = None if settings.prefix_store_path is None else Path(settings.prefix_store_path)
    if root is not None and not root.is_dir():
        raise StartupError(f"PREFIX_STORE_PATH {root} is not a directory")
    store = AdapterStore(
        root,
        is_encoder_decoder=spec.is_encoder_decoder,
        hidden_size=model_hidden_size(spec.model_config),
        dtype=spec.dtype,
        device=spec.device,
        max_prefix_length=limit,
        cache_size_mb=settings.prompt_cache_size_mb,
        metrics=metrics,
    )
    where = f"at {root}" if root is not None else "for runtime LoRA adapters only (no PREFIX_STORE_PATH)"
    logger.info(
        f"Adapter store {where}: prefixes up to {limit} tokens, {settings.prompt_cache_size_mb} MiB cache"
    )
    return store
