"""What transformers' own generate() answers for the same model and input: the tests' ground truth."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer


@dataclass(frozen=True)
class Expected:
    text: str
    generated_token_count: int
    stop_reason: str
    input_token_count: int


@functools.cache
def _load(model_dir: Path):
    config = AutoConfig.from_pretrained(model_dir)
    model_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = model_class.from_pretrained(model_dir).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def greedy(model_dir: Path, text: str, max_new_tokens: int) -> Expected:
    """Solo greedy generation with transformers; text decoded the way the server decodes."""
    model, tokenizer = _load(model_dir)
    ids = tokenizer(text)["input_ids"]
    eos = model.config.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=model.config.pad_token_id,
        )
    new = out[0, 1:] if model.config.is_encoder_decoder else out[0, len(ids) :]
    generated = new.tolist()
    stopped_on_eos = bool(generated) and generated[-1] == eos
    decoded = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Expected(
        text=decoded.rstrip("\ufffd"),
        generated_token_count=len(generated),
        stop_reason="EOS_TOKEN" if stopped_on_eos else "MAX_TOKENS",
        input_token_count=len(ids),
    )
