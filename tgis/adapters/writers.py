"""Writers of adapter store entries: raw `.pt` prefixes, PEFT prompt tuning, PEFT LoRA (tests, the soak)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

# Spread of the random LoRA factors: with lora_alpha = r, B·A adds entries of std r·0.5⁴ (0.25 at
# r = 4), comparable to the tiny models' weights (std 0.3), so outputs visibly move.
LORA_FACTOR_STD = 0.5


def _entry_dir(store: Path, adapter_id: str) -> Path:
    directory = store / adapter_id
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _is_encoder_decoder(base_model_dir: Path) -> bool:
    config = json.loads((base_model_dir / "config.json").read_text(encoding="utf-8"))
    return bool(config.get("is_encoder_decoder", False))


def write_raw_prefix(
    store: Path, adapter_id: str, *, decoder: torch.Tensor | None, encoder: torch.Tensor | None = None
) -> Path:
    """`<store>/<id>/decoder.pt` and/or `encoder.pt`, as TGIS's raw prefix layout has them."""
    directory = _entry_dir(store, adapter_id)
    if decoder is not None:
        torch.save(decoder, directory / "decoder.pt")
    if encoder is not None:
        torch.save(encoder, directory / "encoder.pt")
    return directory


def write_peft_prompt_tuning(
    store: Path,
    adapter_id: str,
    embeddings: torch.Tensor,
    *,
    fmt: Literal["safetensors", "bin"] = "safetensors",
    base_model_dir: Path | None = None,
) -> Path:
    """A PEFT prompt-tuning entry: peft's own `adapter_config.json` plus the `prompt_embeddings` weights."""
    from peft import PromptTuningConfig, TaskType

    directory = _entry_dir(store, adapter_id)
    PromptTuningConfig(
        task_type=TaskType.CAUSAL_LM,
        num_virtual_tokens=int(embeddings.shape[0]),
        token_dim=int(embeddings.shape[-1]),
        num_transformer_submodules=1,
        base_model_name_or_path=str(base_model_dir) if base_model_dir else None,
    ).save_pretrained(str(directory))
    weights = {"prompt_embeddings": embeddings.contiguous()}
    if fmt == "safetensors":
        save_file(weights, str(directory / "adapter_model.safetensors"))
    else:
        torch.save(weights, directory / "adapter_model.bin")
    return directory


def write_lora(
    store: Path,
    adapter_id: str,
    base_model_dir: Path,
    *,
    seed: int,
    r: int = 4,
    target_modules: list[str] | None = None,
) -> Path:
    """A LoRA adapter for the model in `base_model_dir`, saved by peft (safetensors).

    peft's default init makes lora_B zero (a no-op adapter); both factors are drawn from `seed`
    instead, so the adapted model's outputs clearly differ from the base model's."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = _is_encoder_decoder(base_model_dir)
    model_class = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = model_class.from_pretrained(base_model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=r,
        lora_dropout=0.0,
        target_modules=target_modules,
        fan_in_fan_out=model.config.model_type == "gpt2",  # its Conv1D stores weights transposed
        task_type=TaskType.SEQ_2_SEQ_LM if seq2seq else TaskType.CAUSAL_LM,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_FACTOR_STD)
    directory = store / adapter_id
    peft_model.save_pretrained(str(directory), safe_serialization=True)
    return directory
