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
    return _generate(model, tokenizer, text, max_new_tokens)


def greedy_with_lora(model_dir: Path, adapter_dir: Path, text: str, max_new_tokens: int) -> Expected:
    """Solo greedy generation with peft's own model for that LoRA adapter."""
    from peft import PeftModel

    base, tokenizer = _load(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    model_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    model = PeftModel.from_pretrained(model_class.from_pretrained(model_dir), adapter_dir).eval()
    return _generate(model, tokenizer, text, max_new_tokens, config=base.config)


def greedy_with_prefix(
    model_dir: Path,
    text: str,
    max_new_tokens: int,
    *,
    decoder: torch.Tensor | None = None,
    encoder: torch.Tensor | None = None,
) -> Expected:
    """Greedy generation with prompt-tuning embeddings prepended (SPEC §8), by full forward passes:
    decoder-only: [prefix, input]; encoder-decoder: encoder [encoder prefix, input], decoder
    [decoder prefix, start token, generated...]."""
    model, tokenizer = _load(model_dir)
    config = model.config
    ids = tokenizer(text)["input_ids"]
    embed = model.get_input_embeddings()
    eos = config.eos_token_id
    generated: list[int] = []
    with torch.inference_mode():
        inputs = embed(torch.tensor([ids]))[0]
        if config.is_encoder_decoder:
            source = torch.cat([p for p in (encoder, inputs) if p is not None])[None]
            encoded = model.get_encoder()(inputs_embeds=source).last_hidden_state
            start = embed(torch.tensor([config.decoder_start_token_id]))
            target = torch.cat([p for p in (decoder, start) if p is not None])
        else:
            target = torch.cat([p for p in (decoder, inputs) if p is not None])
        while len(generated) < max_new_tokens:
            if config.is_encoder_decoder:
                logits = model(encoder_outputs=(encoded,), decoder_inputs_embeds=target[None]).logits
            else:
                logits = model(inputs_embeds=target[None]).logits
            token = int(logits[0, -1].argmax())
            generated.append(token)
            if token == eos:
                break
            target = torch.cat([target, embed(torch.tensor([token]))])
    return _expected(tokenizer, generated, eos, len(ids))


def _generate(model, tokenizer, text: str, max_new_tokens: int, config=None) -> Expected:
    config = config or model.config
    ids = tokenizer(text)["input_ids"]
    eos = config.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=config.pad_token_id,
        )
    new = out[0, 1:] if config.is_encoder_decoder else out[0, len(ids) :]
    return _expected(tokenizer, new.tolist(), eos, len(ids))


def _expected(tokenizer, generated: list[int], eos: int | None, input_token_count: int) -> Expected:
    stopped_on_eos = bool(generated) and generated[-1] == eos
    decoded = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Expected(
        text=decoded.rstrip("\ufffd"),
        generated_token_count=len(generated),
        stop_reason="EOS_TOKEN" if stopped_on_eos else "MAX_TOKENS",
        input_token_count=input_token_count,
    )
