"""Loading a transformers model for serving: the paged step where the model can run it, else the
padded engine; PT2_COMPILE on either."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from transformers import AutoConfig

from engines.base import EngineConfig, EngineSpec
from engines.common import (
    auto_model_class,
    avoid_per_shape_attention_builds,
    checkpoint_dtype,
    compiled_if_asked,
    config_eos_token_ids,
    paged_engine_if_possible,
    resolve_device,
    resolve_dtype,
)
from engines.cpu_prepack import prepack_linears
from engines.fused_activations import fuse_activations
from engines.hf_transformers.engine import HFTransformersEngine
from engines.paged.engine import PagedHFEngine
from engines.quantized import quantize_model, release_dense_weights
from engines.quantized_checkpoints import checkpoint_quantization, load_quantized_checkpoint

# The loading module keeps the engine's logger name, so its log lines read as before the split.
logger = logging.getLogger("engines.hf_transformers")


def load(config: EngineConfig) -> HFTransformersEngine | PagedHFEngine:
    device = resolve_device(config.device)
    avoid_per_shape_attention_builds(device)
    model_config = AutoConfig.from_pretrained(
        config.model_path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    saved = checkpoint_dtype(model_config)
    dtype = resolve_dtype(config.dtype, device, cpu_bf16=config.cpu_bf16, checkpoint=saved)
    model = _load_model(config, model_config, device, dtype)
    spec = _spec(model, model_config, device, dtype, config.model_path)
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
    kwargs: dict[str, Any] = {"trust_remote_code": config.trust_remote_code}
    if config.attn_implementation:
        kwargs["attn_implementation"] = config.attn_implementation
    checkpoint = checkpoint_quantization(model_config.to_dict())
    if checkpoint is not None:
        model = cast(
            transformers.PreTrainedModel,
            load_quantized_checkpoint(
                model_class, config.model_path, model_config, checkpoint, dtype=dtype, device=device, **kwargs
            ),
        )
    else:
        model = model_class.from_pretrained(config.model_path, dtype=dtype, local_files_only=True, **kwargs)
        model.to(device)
        if config.quantize is not None:
            quantized = quantize_model(model, config.quantize, config.quantize_group_size)
            logger.info(quantized.summary(config.quantize))
    if checkpoint is not None or config.quantize is not None:
        release_dense_weights(model, device)
    model.eval()
    fuse_activations(model)
    if not config.compile:  # PT2_COMPILE's inductor lays its own weights out
        prepack_linears(model)
    return model


def _spec(
    model: transformers.PreTrainedModel,
    model_config: transformers.PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    model_path: Path,
) -> EngineSpec:
    pad = model_config.pad_token_id
    eos_ids = config_eos_token_ids(model_config, model_path)
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
