"""What transformers' own generate() answers for the same model and input: the tests' ground truth."""

from __future__ import annotations

import functools
from collections.abc import Sequence
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
    return _expected(tokenizer, greedy_ids(model, ids, max_new_tokens), end_ids(model), len(ids))


def greedy_with_lora(model_dir: Path, adapter_dir: Path, text: str, max_new_tokens: int) -> Expected:
    """Solo greedy generation with peft's own model for that LoRA adapter."""
    base, tokenizer = _load(model_dir)
    ids = tokenizer(text)["input_ids"]
    generated = greedy_ids(lora_model(model_dir, adapter_dir), ids, max_new_tokens)
    return _expected(tokenizer, generated, end_ids(base), len(ids))


def greedy_with_prefix(
    model_dir: Path,
    text: str,
    max_new_tokens: int,
    *,
    decoder: torch.Tensor | None = None,
    encoder: torch.Tensor | None = None,
) -> Expected:
    """Greedy generation with prompt-tuning embeddings prepended (SPEC §8)."""
    model, tokenizer = _load(model_dir)
    ids = tokenizer(text)["input_ids"]
    generated = greedy_ids_with_prefix(model, ids, max_new_tokens, decoder=decoder, encoder=encoder)
    return _expected(tokenizer, generated, end_ids(model), len(ids))


def lora_model(model_dir: Path, adapter_dir: Path):
    """peft's own model: the adapter loaded into a fresh base model (peft injects layers into it)."""
    from peft import PeftModel

    config = AutoConfig.from_pretrained(model_dir)
    model_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    return PeftModel.from_pretrained(model_class.from_pretrained(model_dir), adapter_dir).eval()


def generate(model, ids: Sequence[int], **options):
    """transformers (or peft) generate() on one sequence of ids, without sampling, with `options` (token
    budget, ending ids, beams...): its output, and where the generated ids start in each of its rows."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([list(ids)]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
            **options,
        )
    return out, 1 if model.config.is_encoder_decoder else len(ids)


def end_ids(model) -> list[int]:
    """The ids generation ends at, as the server takes them: generation_config.json's end ids (a chat
    checkpoint may add its own to config.json's EOS, tests/fixtures/chat.py), else config.json's EOS."""
    ends = model.generation_config.eos_token_id
    if ends is None:
        ends = model.config.eos_token_id
    return [] if ends is None else [ends] if isinstance(ends, int) else list(ends)


def greedy_ids(model, ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers (or peft) generate() on one sequence: the ids it generates, up to an end id."""
    out, start = generate(model, ids, max_new_tokens=max_new_tokens, eos_token_id=end_ids(model))
    return out[0, start:].tolist()


def greedy_ids_with_prefix(
    model,
    ids: Sequence[int],
    max_new_tokens: int,
    *,
    decoder: torch.Tensor | None = None,
    encoder: torch.Tensor | None = None,
) -> list[int]:
    """Greedy ids with prompt-tuning embeddings prepended. Decoder-only: generate() on
    [decoder prefix, token embeddings]. Encoder-decoder, by full forward passes: encoder [encoder
    prefix, token embeddings], decoder [decoder prefix, start token, generated tokens]."""
    config = model.config
    embed = model.get_input_embeddings()
    generated: list[int] = []
    with torch.inference_mode():
        inputs = embed(torch.tensor([list(ids)]))[0]
        if not config.is_encoder_decoder:
            embeds = torch.cat([p for p in (decoder, inputs) if p is not None])[None]
            out = model.generate(
                inputs_embeds=embeds,
                attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=config.pad_token_id,
            )
            return out[0].tolist()  # with inputs_embeds only, generate returns the new tokens alone
        source = torch.cat([p for p in (encoder, inputs) if p is not None])[None]
        encoded = model.get_encoder()(inputs_embeds=source).last_hidden_state
        start = embed(torch.tensor([config.decoder_start_token_id]))
        target = torch.cat([p for p in (decoder, start) if p is not None])
        while len(generated) < max_new_tokens and (not generated or generated[-1] != config.eos_token_id):
            logits = model(encoder_outputs=(encoded,), decoder_inputs_embeds=target[None]).logits
            generated.append(int(logits[0, -1].argmax()))
            target = torch.cat([target, embed(torch.tensor([generated[-1]]))])
    return generated


def _expected(tokenizer, generated: list[int], ends: Sequence[int], input_token_count: int) -> Expected:
    """The server's answer for these generated ids: an end id last is counted but its text is not part
    of the answer (a special token's, or a second end id's that is an ordinary token)."""
    stopped_on_eos = bool(generated) and generated[-1] in ends
    answer = generated[:-1] if stopped_on_eos else generated
    decoded = tokenizer.decode(answer, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Expected(
        text=decoded.rstrip("\ufffd"),
        generated_token_count=len(generated),
        stop_reason="EOS_TOKEN" if stopped_on_eos else "MAX_TOKENS",
        input_token_count=input_token_count,
    )
