"""Speculative decoding in the paged runner: drafts for the decoding sequences, and their verification.

A decoding sequence with a draft of k tokens brings k + 1 positions to the step (its newest token and
the draft), and the engine returns the logits of all of them. Verification then samples one position
at a time, over the sequences still accepting, from exactly the distribution the model gives that
position after the tokens accepted before it: a token equal to the draft's is accepted and the next
position is sampled; the first one that differs ends the sequence's run, and is kept. Every emitted
token is therefore drawn as it would have been without speculation, with the row's penalties,
grammar and generator in the same state: greedy output is identical token for token, and a seed
reproduces the same tokens with speculation on or off. A draft token d is accepted with probability
p(d), the speculative-sampling rule for a draft that proposes one token per position.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engines.speculative.mlp import MLPSpeculator
from tgis.speculation.gate import BatchGate, CostGate, SequenceGate
from tgis.speculation.ngram import NgramIndex


class Proposer(Protocol):
    """Where drafts come from; it sees every sequence's tokens as they are accepted, and, when it
    `wants_hidden`, the model's final hidden state at the position that produced the newest one."""

    wants_hidden: bool

    def start(self, task_id: int, prompt: Sequence[int]) -> None: ...

    def extend(self, task_id: int, tokens: Sequence[int], hidden: torch.Tensor | None = None) -> None: ...

    def stop(self, task_id: int) -> None: ...

    def propose(self, task_ids: Sequence[int], count: int) -> dict[int, tuple[int, ...]]:
        """Up to `count` tokens for each of the sequences (none for some is fine)."""
        ...


class NgramProposer:
    """Prompt lookup (tgis.speculation.ngram) over each sequence's own tokens."""

    wants_hidden = False

    def __init__(self) -> None:
        self._indexes: dict[int, NgramIndex] = {}

    def start(self, task_id: int, prompt: Sequence[int]) -> None:
        self._indexes[task_id] = NgramIndex(prompt)

    def extend(self, task_id: int, tokens: Sequence[int], hidden: torch.Tensor | None = None) -> None:
        self._indexes[task_id].extend(tokens)

    def stop(self, task_id: int) -> None:
        self._indexes.pop(task_id, None)

    def propose(self, task_ids: Sequence[int], count: int) -> dict[int, tuple[int, ...]]:
        drafts = {task_id: self._indexes[task_id].propose(count) for task_id in task_ids}
        return {task_id: draft for task_id, draft in drafts.items() if draft}


class MLPProposer:
    """TGIS's MLP speculator (engines.speculative.mlp): its heads extend the model's last hidden state
    and newest token into a chain of greedy guesses, one batched call for every sequence."""

    wants_hidden = True

    def __init__(self, speculator: MLPSpeculator) -> None:
        self.speculator = speculator
        self._state: dict[int, tuple[torch.Tensor, int]] = {}  # hidden state, newest token

    def start(self, task_id: int, prompt: Sequence[int]) -> None:
        self._state.pop(task_id, None)  # no state before the model has seen the prompt

    def extend(self, task_id: int, tokens: Sequence[int], hidden: torch.Tensor | None = None) -> None:
        if hidden is not None and tokens:
            self._state[task_id] = (hidden, tokens[-1])

    def stop(self, task_id: int) -> None:
        self._state.pop(task_id, None)

    def propose(self, task_ids: Sequence[int], count: int) -> dict[int, tuple[int, ...]]:
        ready = [task_id for task_id in task_ids if task_id in self._state]
        count = min(count, self.speculator.config.n_predict)
        if not ready or count <= 0:
            return {}
        hidden = torch.stack([self._state[task_id][0] for task_id in ready])
        last = torch.tensor([self._state[task_id][1] for task_id in ready], device=hidden.device)
        chains = self.speculator.propose(hidden, last, count).tolist()
        return {task_id: tuple(chain) for task_id, chain in zip(ready, chains, strict=True)}


@dataclass
class Speculation:
    """The runner's speculation: which sequences propose, how much, and how well it went."""

    proposer: Proposer
    max_tokens: int  # k: tokens proposed per sequence and step at most
    batch_gate: BatchGate
    # None: speculate at every batch size the batch gate allows (tests whose engines have no real cost)
    cost_gate: CostGate | None = field(default_factory=CostGate)
    _gates: dict[int, SequenceGate] = field(default_factory=dict)

    def __len__(self) -> int:
        """Sequences with state here (a gate, and the proposer's state beside it)."""
        return len(self._gates)

    def start(self, task_id: int, prompt: Sequence[int]) -> None:
        self.proposer.start(task_id, prompt)
        self._gates[task_id] = SequenceGate(self.max_tokens)

    def stop(self, task_ids: Iterable[int]) -> None:
        for task_id in task_ids:
            if self._gates.pop(task_id, None) is not None:
                self.proposer.stop(task_id)

    def drafts(self, decoding: Sequence[int], prompts_pending: bool = False) -> dict[int, tuple[int, ...]]:
        """Drafts for the decoding sequences the gates let speculate now. Not in a step that will carry
        prompt chunks: such a step is bound by their compute, not by reading the weights, so draft
        positions there cost as much as they save (and take token budget from the prompts)."""
        if not decoding or prompts_pending or not self.batch_gate.allows(len(decoding)):
            return {}
        if self.cost_gate is not None and not self.cost_gate.allows(len(decoding)):
            return {}
        allowed = [
            task_id for task_id in decoding if task_id in self._gates and self._gates[task_id].allows()
        ]
        if not allowed:
            return {}
        lengths = {task_id: self._gates[task_id].draft_length for task_id in allowed}
        proposed = self.proposer.propose(allowed, max(lengths.values()))
        return {task_id: draft[: lengths[task_id]] for task_id, draft in proposed.items()}

    def observe_step(self, decoding: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A pure decode step's cost, for the cost gate."""
        if self.cost_gate is not None:
            self.cost_gate.record(decoding, speculated, seconds, tokens)

    @property
    def wants_hidden(self) -> bool:
        return self.proposer.wants_hidden

    def record(
        self, task_id: int, tokens: Sequence[int], proposed: int, accepted: int, hidden: torch.Tensor | None
    ) -> None:
        """A step's outcome for one sequence: its new tokens (with the final hidden state that produced
        the newest, for proposers that read it), and how its draft fared."""
        gate = self._gates.get(task_id)
        if gate is None:
            return
        self.proposer.extend(task_id, tokens, hidden)
        gate.record(proposed, accepted)
