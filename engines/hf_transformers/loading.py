"""Loading a transformers model for serving: the paged step where the model can run it, else the
padded engine; PT2_COMPILE on either."""

from __future__ import annotations

import dataclasses
import json
import logging

import torch
import transformers
from transformers import AutoConfig

from engines.base import EngineConfig, EngineSpec
from engines.common import (
    UnsupportedModelError,
    auto_model_class,
    avoid_per_shape_attention_builds,
    config_eos_token_ids,
    resolve_device,
    resolve_dtype,
)
from engines.compiled import compile_model
from engines.cpu_prepack import prepack_linears
from engines.fused_activations import fuse_activations
from engines.hf_transformers.engine import HFTransformersEngine
from engines.paged import cpu_kernel, forward
from engines.paged.engine import PagedHFEngine, PagedUnsupportedError
from engines.paged.engine import build as build_paged

# The loading module keeps the engine's logger name, so its log lines read as before the split.
logger = logging.getLogger("engines.hf_transformers")


def load(config: EngineConfig) -> HFTransformersEngine | PagedHFEngine:
    device = resolve_device(config.device)
    avoid_per_shape_attention_builds(device)
    dtype = resolve_dtype(config.dtype, device, cpu_bf16=config.cpu_bf16)
    model_config = AutoConfig.from_pretrained(
        config.model_path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    model = _load_model(config, model_config, device, dtype)
    spec = _spec(model, model_config, device, dtype)
    logger.info(f"Loaded {model_config.model_type} from {config.model_path} on {device} as {dtype}")
    paged = paged_engine_if_possible(model, spec, config)
    if paged is not None:
        return paged
    return HFTransformersEngine(model, compiled_if_asked(model, spec, config))


def _load_model(
    config: EngineConfig,
    model_config: transformers.PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> transformers.PreTrainedModel:
    """The model on `device` in eval mode, its activations fused and (unless compiled) CPU linears
    prepacked (compiled, the paged step packs them itself: `compiled_if_asked`)."""
    model_class = auto_model_class(model_config)
    kwargs = {"attn_implementation": config.attn_implementation} if config.attn_implementation else {}
    model = model_class.from_pretrained(
        config.model_path,
        dtype=dtype,
        local_files_only=True,
        trust_remote_code=config.trust_remote_code,
        **kwargs,
    )
    model.to(device).eval()
    fuse_activations(model)
    if not config.compile:  # PT2_COMPILE's inductor lays its own weights out
        prepack_linears(model)
    return model


def _spec(
    model: transformers.PreTrainedModel,
    model_config: transformers.PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> EngineSpec:
    pad = model_config.pad_token_id
    eos_ids = config_eos_token_ids(model_config)
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    return EngineSpec(
        is_encoder_decoder=bool(model_config.is_encoder_decoder),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad),
        device=device,
        dtype=dtype,
        model_config=json.loads(model_config.to_json_string()),
    )


def load_padded(config: EngineConfig) -> HFTransformersEngine:
    """The padded engine whatever the model supports (for callers that drive rows directly)."""
    engine = load(dataclasses.replace(config, paged=False))
    assert isinstance(engine, HFTransformersEngine)
    return engine


def paged_engine_if_possible(
    model: transformers.PreTrainedModel, spec: EngineSpec, config: EngineConfig
) -> PagedHFEngine | None:
    """The paged engine unless PAGED_ATTENTION=false or the model cannot run it (then None, or a
    startup error when the paged step was required)."""
    if config.paged is False:
        return None
    try:
        engine = build_paged(model, dataclasses.replace(spec, paged=True))
    except PagedUnsupportedError as exc:
        reason = str(exc)
    else:
        logger.info("Serving with the paged step (flat batches over KV blocks, chunked prefill)")
        engine.spec = compiled_if_asked(model, engine.spec, config, paged=True)
        return engine
    if config.paged:
        raise UnsupportedModelError(
            f"The paged step (PAGED_ATTENTION / FLASH_ATTENTION) cannot serve: {reason}"
        )
    logger.info(f"Serving with padded batches: {reason}")
    return None


def compiled_if_asked(
    model: torch.nn.Module, spec: EngineSpec, config: EngineConfig, *, paged: bool = False
) -> EngineSpec:
    """PT2_COMPILE: compile the forward; LoRA is refused then, as peft's per-row hooks would recompile it.
    The paged step on the CPU keeps its packed linears and its attention kernel as operators of the
    graph where the kernels build and oneDNN packs the dtype (engines/compiled.py)."""
    if not config.compile:
        return spec
    operators = paged and spec.device.type == "cpu" and cpu_kernel.kernels() is not None
    # Every size packed, as PT2_COMPILE's graphs were measured: a graph of packed operators calls them
    # from its C++ wrapper, and a model with none is frozen for inductor instead (compile_model).
    packed = operators and prepack_linears(model, min_bytes=0) > 0
    compile_model(model, packed_linears=packed, whole_graph=forward.traces_whole if operators else None)
    if operators:
        logger.info(
            "PT2_COMPILE: the paged step's attention kernel is an operator of the compiled graph; linear "
            + ("layers packed for oneDNN, called as they are" if packed else "layers left to inductor")
        )
    return dataclasses.replace(spec, supports_lora=False)
