"""Distilling an MLP speculator from a frozen causal LM, and measuring how often its proposals are accepted.

The teacher targets are the LM's own greedy tokens, which is what a speculator needs to match for greedy
decoding to accept its proposals. Training positions come from transcripts: a prompt (real text) followed
by the LM's greedy continuation, so most states are the ones decoding actually meets.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from engines.common import cache_keyword, fixed_threads, lm_head_inputs
from engines.kv_cache import GrowingCache
from engines.speculative.mlp import MLPSpeculator, MLPSpeculatorConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillPlan:
    """Everything besides the data and the config that decides the trained weights."""

    steps: int = 800
    lr: float = 2e-2
    batch_size: int = 512  # positions per step
    warmup_steps: int = 10
    new_tokens: int = 96  # greedy tokens the target adds to each prompt
    # Train only from the last prompt position on, where states and chains are the ones greedy decoding
    # meets, or on the prompt's real-text positions too (whose chains are text, not greedy tokens).
    prompt_positions: bool = False
    seed: int = 0
    threads: int = 2  # the thread count changes how float sums split, so it is part of the recipe


@dataclass(frozen=True)
class Transcript:
    """Prompts with the target's greedy continuation and what the target computed along the way.

    tokens [N, L]; hidden [N, L-1, D] and greedy [N, L-1]: at position t, the LM head's input and its
    argmax, the token the target would put at t+1 (equal to tokens[:, t+1] after the prompt).
    """

    tokens: torch.Tensor
    hidden: torch.Tensor
    greedy: torch.Tensor
    prompt_length: int


@dataclass(frozen=True)
class Acceptance:
    """How a speculator's greedy chains compare with the target's greedy continuation, over decode steps."""

    per_position: tuple[float, ...]  # share of steps where proposal i equals the target's token i
    mean_accepted: float  # mean count of leading proposals that match: the tokens a step gains
    steps: int

    @classmethod
    def from_matches(cls, matches: torch.Tensor) -> Acceptance:
        """From [steps, k] booleans: whether proposal i of a step equals the target's token i."""
        return cls(
            per_position=tuple(matches.float().mean(dim=0).tolist()),
            mean_accepted=matches.int().cumprod(dim=1).sum(dim=1).float().mean().item(),
            steps=matches.shape[0],
        )

    @property
    def overall(self) -> float:
        """The share of all proposed tokens that equal the target's token at their position."""
        return sum(self.per_position) / len(self.per_position)


def greedy_transcripts(
    target: nn.Module, prompts: torch.Tensor, new_tokens: int, batch_size: int = 256
) -> Transcript:
    """The target's greedy continuation of each prompt [N, P] by `new_tokens`, with its states."""
    parts = [_greedy_batch(target, batch, new_tokens) for batch in prompts.split(batch_size)]
    return Transcript(
        tokens=torch.cat([p[0] for p in parts]),
        hidden=torch.cat([p[1] for p in parts]),
        greedy=torch.cat([p[2] for p in parts]),
        prompt_length=prompts.shape[1],
    )


def _greedy_batch(
    target: nn.Module, prompts: torch.Tensor, new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Every row has the same length, so no padding or attention mask is needed. The cache fills in place.
    tokens, hidden, greedy = [prompts], [], []
    cache = {cache_keyword(target): GrowingCache()}
    with torch.inference_mode(), lm_head_inputs(target) as seen:
        logits = target(input_ids=prompts, use_cache=True, **cache).logits
        for step in range(new_tokens + 1):
            hidden.append(seen.pop().float())
            greedy.append(logits.argmax(dim=-1))
            if step == new_tokens:
                break
            tokens.append(greedy[-1][:, -1:])
            logits = target(input_ids=tokens[-1], use_cache=True, **cache).logits
    # The last state produced a token past the transcript; drop it so t+1 always exists.
    return torch.cat(tokens, dim=1), torch.cat(hidden, dim=1)[:, :-1], torch.cat(greedy, dim=1)[:, :-1]


def distillation_examples(
    transcript: Transcript, n_predict: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position t from `first`: the state h_t [E, D], the chain tokens[t+1 .. t+n] fed to the heads
    [E, n], and the target's greedy tokens greedy[t+1 .. t+n] that the heads must predict [E, n]."""
    end = transcript.hidden.shape[1] - n_predict  # t + n_predict must be a position with a state
    if end <= first:
        raise ValueError(
            f"transcripts of {transcript.tokens.shape[1]} tokens are too short for {n_predict} heads"
        )
    hidden = transcript.hidden[:, first:end].reshape(-1, transcript.hidden.shape[-1])
    chain = torch.stack([transcript.tokens[:, first + 1 + i : end + 1 + i] for i in range(n_predict)], -1)
    targets = torch.stack([transcript.greedy[:, first + 1 + i : end + 1 + i] for i in range(n_predict)], -1)
    return hidden, chain.reshape(-1, n_predict), targets.reshape(-1, n_predict)


def train_speculator(
    target: nn.Module, prompts: torch.Tensor, config: MLPSpeculatorConfig, plan: DistillPlan | None = None
) -> MLPSpeculator:
    """A speculator for `target` (frozen, on CPU) distilled from its greedy continuations of `prompts`
    [N, P]; deterministic for a given plan, data and machine."""
    plan = plan or DistillPlan()
    with fixed_threads(plan.threads), torch.random.fork_rng():
        started = time.perf_counter()
        transcript = greedy_transcripts(target, prompts, plan.new_tokens)
        first = 0 if plan.prompt_positions else prompts.shape[1] - 1
        examples = distillation_examples(transcript, config.n_predict, first)
        if examples[0].shape[1] != config.emb_dim:
            raise ValueError(
                f"the target's hidden size is {examples[0].shape[1]}, the config's emb_dim {config.emb_dim}"
            )
        transcribed = time.perf_counter()
        logger.info(
            f"Distilling a speculator: {len(examples[0])} positions from {len(prompts)} greedy transcripts "
            f"of {transcript.tokens.shape[1]} tokens in {transcribed - started:.1f}s"
        )
        torch.manual_seed(plan.seed)
        speculator = MLPSpeculator(config)
        final_loss = _fit(speculator, examples, plan)
        logger.info(
            f"Fitted {plan.steps} steps in {time.perf_counter() - transcribed:.1f}s "
            f"(final loss per head {final_loss:.3f})"
        )
    return speculator.eval().requires_grad_(False)


def _fit(
    speculator: MLPSpeculator, examples: tuple[torch.Tensor, torch.Tensor, torch.Tensor], plan: DistillPlan
) -> float:
    """Train in place; returns the last step's mean cross-entropy per head."""
    hidden, chain, targets = examples
    optimizer = torch.optim.AdamW(speculator.parameters(), lr=plan.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, plan))
    batches = torch.Generator().manual_seed(plan.seed)
    speculator.train()
    loss = torch.tensor(math.nan)
    for _ in range(plan.steps):
        rows = torch.randint(0, hidden.shape[0], (plan.batch_size,), generator=batches)
        logits = speculator(hidden[rows], chain[rows])  # [n, B, V]
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets[rows].T.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return loss.item()


def _lr_factor(step: int, plan: DistillPlan) -> float:
    # Linear warmup, then cosine decay to a tenth.
    if step < plan.warmup_steps:
        return (step + 1) / plan.warmup_steps
    progress = (step - plan.warmup_steps) / max(1, plan.steps - plan.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def measure_acceptance(
    target: nn.Module, speculator: MLPSpeculator, prompts: torch.Tensor, new_tokens: int, k: int
) -> Acceptance:
    """Decode each prompt greedily for `new_tokens`; at every step propose k tokens from the state that
    produced the step's token and compare them with the target's next k greedy tokens."""
    transcript = greedy_transcripts(target, prompts, new_tokens)
    first, last = transcript.prompt_length - 1, transcript.hidden.shape[1] - k
    if last < first:
        raise ValueError(f"{new_tokens} new tokens leave no decode step with {k} tokens to compare")
    # Every decode step at once: step t proposes from h_t and the token h_t produced, tokens[t+1].
    hidden = transcript.hidden[:, first:last].reshape(-1, transcript.hidden.shape[-1])
    last_tokens = transcript.tokens[:, first + 1 : last + 1].reshape(-1)
    truth = torch.stack([transcript.tokens[:, first + 2 + i : last + 2 + i] for i in range(k)], dim=-1)
    return Acceptance.from_matches(speculator.propose(hidden, last_tokens, k) == truth.reshape(-1, k))
