"""Drives engines the way the engine loop does, and what transformers answers for the same input."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from engines.base import Engine, PrefillRow
from tests.integration import reference

NEW_TOKENS = 12


@functools.cache
def reference_model(model_dir: Path):
    config = AutoConfig.from_pretrained(model_dir)
    model_class = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    return model_class.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.cache
def prompt_ids(model_dir: Path, text: str) -> tuple[int, ...]:
    return tuple(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])


@functools.cache
def reference_greedy(model_dir: Path, ids: tuple[int, ...], new_tokens: int = NEW_TOKENS) -> tuple[int, ...]:
    """transformers generate() on one sequence: the token ids an engine must produce for it."""
    return tuple(reference.greedy_ids(reference_model(model_dir), ids, new_tokens))


def reference_logprobs(model_dir: Path, ids: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """Log-probability transformers gives each generated token, from one full forward."""
    model = reference_model(model_dir)
    with torch.inference_mode():
        if model.config.is_encoder_decoder:
            decoder = [model.config.decoder_start_token_id, *generated[:-1]]
            logits = model(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([decoder])).logits[0]
        else:
            full = torch.tensor([[*ids, *generated]])
            logits = model(input_ids=full).logits[0, len(ids) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(generated)[:, None])[:, 0]


# ---- driving an engine the way the engine loop does ---------------------------------------------------


@dataclass
class Run:
    """Greedy decoding over an engine's running batch; rows join and leave by name."""

    engine: Engine
    eos: frozenset[int]
    limit: int = NEW_TOKENS
    names: list[str] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)

    def _take(self, names: Sequence[str], logits: torch.Tensor) -> None:
        chosen = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, chosen[:, None])[:, 0]
        for name, token, logprob in zip(names, chosen.tolist(), logprobs.tolist(), strict=True):
            self.tokens.setdefault(name, []).append(token)
            self.logprobs.setdefault(name, []).append(logprob)
        self.last = [self.tokens[name][-1] for name in self.names]

    def join(self, prompts: Mapping[str, Sequence[int]]) -> None:
        result = self.engine.prefill([PrefillRow(tuple(ids)) for ids in prompts.values()])
        self.names += list(prompts)
        self._take(list(prompts), result.next_token_logits)
        self.leave_finished()

    def step(self) -> None:
        self._take(self.names, self.engine.decode(self.last))
        self.leave_finished()

    def leave(self, names: Sequence[str]) -> None:
        keep = [i for i, name in enumerate(self.names) if name not in names]
        self.engine.keep_rows(keep)
        self.names = [self.names[i] for i in keep]
        self.last = [self.last[i] for i in keep]

    def leave_finished(self) -> None:
        done = [n for n in self.names if self.tokens[n][-1] in self.eos or len(self.tokens[n]) >= self.limit]
        if done:
            self.leave(done)

    def finish(self) -> None:
        while self.names:
            self.step()
