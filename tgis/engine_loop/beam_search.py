"""One request's beam search: which continuations of its running beams run next, and its finished beams.

The rules are transformers' `generate(num_beams=k)` (its `_beam_search`), so that the same model
returns the same beams with the same scores:
- each step takes the log-softmax of every running beam's logits, then bans what the request bans
  (EOS under `min_new_tokens`, bad words), adds each beam's running sum, and keeps the best
  max(2, 1 + E) × k continuations over all beams (E: the ids that end a beam);
- a continuation that ends (an ending id, or the token budget) and ranks among the first k becomes a
  finished beam, scored sum / generated_length ** length_penalty; the best k finished ones are kept;
- the best k continuations that do not end run on;
- the search stops once no running beam can beat the worst of k finished ones (early_stopping False:
  judged at the current length; "never" with a positive penalty: at the longest length), once k beams
  have finished (early_stopping True), or when every continuation ends.

Pure: the runner hands it the running beams' logits rows and moves the beams' KV blocks as the
answer says (tgis.batching.paged forks a beam's blocks instead of copying its prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tgis.engine_loop.tasks import GenerationTask
from tgis.sampling.bad_words import TokenSequences, ban_, completing_ids
from tgis.types import BeamParams

_UNREACHABLE = -1.0e9  # transformers' mask for continuations that may not run or finish


@dataclass(frozen=True)
class FinishedBeam:
    token_ids: tuple[int, ...]  # generated, the ending id included
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    ended: bool  # by an ending id (else by the token budget)


@dataclass(frozen=True)
class Continuation:
    """A running beam of the next step: running beam `parent` of this step, plus `token_id`."""

    parent: int
    token_id: int


@dataclass
class BeamSearch:
    params: BeamParams
    max_new_tokens: int
    ending_ids: frozenset[int]
    min_new_tokens: int = 0
    bad_words: TokenSequences = ()
    context: tuple[int, ...] = ()  # what bad words are checked against before the generated tokens
    running: list[list[int]] = field(default_factory=lambda: [[]])  # each running beam's tokens
    finished: list[FinishedBeam] = field(default_factory=list)  # best first, at most `width`
    done: bool = False
    generated: int = 0  # tokens every running beam holds (they advance together)
    _sums: torch.Tensor = field(default_factory=lambda: torch.zeros(1))  # running beams' sums, float32
    _improvable: bool = True

    @property
    def width(self) -> int:
        return self.params.width

    def advance(self, logits: torch.Tensor) -> list[Continuation]:
        """One step from logits [running beams, V] (row i: running beam i); returns the next running
        beams, best first (empty once `done`)."""
        if self.done:
            raise ValueError("the beam search has ended")
        if logits.shape[0] != len(self.running):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(self.running)} running beams")
        totals = self._log_probs(logits) + self._sums.to(logits.device).unsqueeze(1)
        vocab = totals.shape[1]
        keep = min(max(2, 1 + len(self.ending_ids)) * self.width, totals.numel())
        values, indices = torch.topk(totals.reshape(-1), keep)
        values = values.cpu()
        self.generated += 1
        length = self.generated
        candidates = [(i // vocab, i % vocab) for i in indices.tolist()]
        ends = [token in self.ending_ids or length >= self.max_new_tokens for _, token in candidates]
        self._collect_finished(candidates, ends, values, length)
        order = sorted(range(keep), key=lambda r: (ends[r], r))[: self.width]  # non-ending first, by rank
        next_beams = [Continuation(*candidates[r]) for r in order if not ends[r]]
        self.running = [[*self.running[c.parent], c.token_id] for c in next_beams]
        running_sums = values[[r for r in order if not ends[r]]]
        self._sums = running_sums
        self._judge(running_sums, length)
        self.done = self.done or all(ends) or not next_beams
        if self.done:
            return []
        return next_beams

    def best(self, n: int) -> list[FinishedBeam]:
        return self.finished[:n]

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-softmax first, then the bans (as transformers applies its processors to log-probs)."""
        scores = torch.log_softmax(logits.to(torch.float32), dim=-1)
        if self.generated < self.min_new_tokens:
            for token in self.ending_ids:
                scores[:, token] = float("-inf")
        if self.bad_words:
            banned = [completing_ids((*self.context, *beam), self.bad_words) for beam in self.running]
            scores = ban_(scores, banned)
        return scores

    def _collect_finished(
        self, candidates: Sequence[tuple[int, int]], ends: Sequence[bool], values: torch.Tensor, length: int
    ) -> None:
        """The first `width` continuations that end become finished beams, while they may still count."""
        full = len(self.finished) == self.width
        if not self._improvable or (full and self.params.early_stopping is True):
            return
        scores = values / (length**self.params.length_penalty)  # float32, as transformers divides
        added = False
        for rank in range(self.width):
            if not ends[rank]:
                continue
            parent, token = candidates[rank]
            beam = FinishedBeam(
                token_ids=(*self.running[parent], token),
                cumulative_logprob=float(values[rank]),
                score=float(scores[rank]),
                ended=token in self.ending_ids,
            )
            self.finished.append(beam)
            added = True
        if added:
            self.finished.sort(key=lambda beam: beam.score, reverse=True)
            del self.finished[self.width :]

    def _judge(self, running_sums: torch.Tensor, length: int) -> None:
        """Whether the best running beam could still beat the worst finished one (once `width` have
        finished), and whether `early_stopping` ends the search now."""
        full = len(self.finished) == self.width
        if full and self.params.early_stopping is True:
            self.done = True
            return
        if not full or not len(running_sums):
            return
        penalty = self.params.length_penalty
        hypothetical = (
            self.max_new_tokens if self.params.early_stopping == "never" and penalty > 0 else length
        )
        best_possible = running_sums[:1] / (hypothetical**penalty)
        worst = torch.tensor(min(beam.score for beam in self.finished), dtype=torch.float32)
        if not bool((best_possible > worst).all()):
            self._improvable = False
            self.done = True


def for_task(task: GenerationTask, eos_token_ids: frozenset[int], encoder_decoder: bool) -> BeamSearch:
    """The search a beam request asks for: its beams end on EOS or its stop_token_ids, or at its token
    budget; bad words are checked against the prompt too on decoder-only models."""
    params = task.input.params
    assert params.beam is not None
    return BeamSearch(
        params.beam,
        max_new_tokens=task.input.max_new_tokens,
        ending_ids=eos_token_ids | set(params.stopping.stop_token_ids),
        min_new_tokens=params.stopping.min_new_tokens,
        bad_words=params.bad_words,
        context=() if encoder_decoder else task.input.input_ids,
    )
