"""The sampler's rows, addressed by task id: the runners' one map from a request to its sampler row, and
the draft verification of speculative steps (only this module touches the BatchSampler)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engines.base import EngineSpec
from tgis.engine_loop.results import SampledToken
from tgis.engine_loop.tasks import GenerationTask
from tgis.sampling import BatchSampler


@dataclass
class Verified:
    tokens: dict[int, list[SampledToken]]  # every sequence's emitted tokens, in order
    guide_finished: set[int]

    def accepted(self, task_id: int) -> int:
        return len(self.tokens[task_id]) - 1


class SampledRows:
    """The sampler's rows, addressed by task id: the runners' one map from a request to its row."""

    def __init__(self, spec: EngineSpec, eos_token_ids: Sequence[int]) -> None:
        self._spec = spec
        self._eos = tuple(eos_token_ids)
        self._sampler = BatchSampler(spec.vocab_size, self._eos, spec.device)
        self.ids: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, task: GenerationTask) -> None:
        """A row for `task` after the others; raises, changing nothing, if the sampler refuses it."""
        context = () if self._spec.is_encoder_decoder else task.input.input_ids
        self._sampler.add_rows([task.input.sampling], [context])
        self.ids.append(task.id)

    def remove(self, task_ids: Iterable[int]) -> None:
        gone = set(task_ids)
        keep = [i for i, task_id in enumerate(self.ids) if task_id not in gone]
        if len(keep) != len(self.ids):
            self._sampler.keep_rows(keep)
            self.ids = [self.ids[i] for i in keep]

    def sample(
        self, logits: torch.Tensor, logit_ids: Sequence[int]
    ) -> tuple[dict[int, SampledToken], set[int]]:
        """Choose every row's next token from `logits`, whose i-th row belongs to `logit_ids[i]` (rows of
        other ids are ignored). Returns the tokens by id and the ids whose grammar just terminated."""
        return self.sample_rows(logits, {task_id: row for row, task_id in enumerate(logit_ids)})

    def sample_rows(
        self, logits: torch.Tensor, row_of: Mapping[int, int]
    ) -> tuple[dict[int, SampledToken], set[int]]:
        """The same, `row_of[id]` naming the row of `logits` that belongs to each id."""
        if not self.ids:  # e.g. the step's only prompt failed to start sampling: nothing to choose
            return {}, set()
        sample = self._sampler.sample(pick_rows(logits, [row_of[task_id] for task_id in self.ids]))
        tokens = {
            task_id: SampledToken(token_id, detail)
            for task_id, token_id, detail in zip(self.ids, sample.token_ids, sample.details, strict=True)
        }
        return tokens, {self.ids[position] for position in sample.guide_finished}

    def extend(self, other: SampledRows) -> None:
        """Append another set's rows (a prefilled group joining the running batch) after these."""
        self._sampler.extend(other._sampler)
        self.ids += other.ids

    def clear(self) -> None:
        self._sampler = BatchSampler(self._spec.vocab_size, self._eos, self._spec.device)
        self.ids = []

    def verify(
        self,
        logits: torch.Tensor,
        rows_of: Mapping[int, Sequence[int]],
        drafts: Mapping[int, Sequence[int]],
    ) -> Verified:
        """Sample every sequence, position by position: `rows_of[id]` names its rows of `logits`, one for
        each draft token and one before them (only the one without a draft); a run goes on while its
        tokens equal its draft. Each position's logits are gathered in one call for every sequence; when
        no row's scores depend on its earlier tokens (greedy rows, as most are), one call chooses every
        position of every sequence (`_verify_greedy`)."""
        verified = Verified({task_id: [] for task_id in self.ids}, set())
        if not self.ids:
            return verified
        if self._sampler.chooses_ahead:
            return self._verify_greedy(logits, rows_of, drafts)
        row_of = {task_id: row for row, task_id in enumerate(self.ids)}
        alive = list(self.ids)
        position = 0
        while alive:
            # A sequence that stopped accepting keeps its last row: the sampler ignores rows not active.
            picked = [rows_of[task_id][min(position, len(rows_of[task_id]) - 1)] for task_id in self.ids]
            current = pick_rows(logits, picked)
            sample = self._sampler.sample(current, [row_of[task_id] for task_id in alive])
            finished = {self.ids[row] for row in sample.guide_finished}
            verified.guide_finished |= finished
            going_on = []
            for task_id in alive:
                row = row_of[task_id]
                token = SampledToken(sample.token_ids[row], sample.details[row])
                verified.tokens[task_id].append(token)
                draft = drafts.get(task_id, ())
                if position < len(draft) and token.token_id == draft[position] and task_id not in finished:
                    going_on.append(task_id)
            position += 1
            alive = going_on
        return verified

    def _verify_greedy(
        self,
        logits: torch.Tensor,
        rows_of: Mapping[int, Sequence[int]],
        drafts: Mapping[int, Sequence[int]],
    ) -> Verified:
        """`verify` when no position's scores depend on the tokens before it (BatchSampler.chooses_ahead):
        every position of every sequence is chosen in one call, and each run ends at its first token
        that differs from its draft, as position by position it would."""
        picked, owners, ahead = [], [], []
        for row, task_id in enumerate(self.ids):
            for position, kept_row in enumerate(rows_of[task_id]):
                picked.append(kept_row)
                owners.append(row)
                ahead.append(position)
        chosen = iter(self._sampler.greedy_ahead(pick_rows(logits, picked), owners, ahead))
        runs = []
        for task_id in self.ids:
            draft = drafts.get(task_id, ())
            choices = [next(chosen) for _ in rows_of[task_id]]
            kept = 1
            while kept < len(choices) and choices[kept - 1] == draft[kept - 1]:
                kept += 1
            runs.append(choices[:kept])
        self._sampler.advance_rows(runs)
        by_id = zip(self.ids, runs, strict=True)
        return Verified(
            {task_id: [SampledToken(token, None) for token in run] for task_id, run in by_id}, set()
        )


def pick_rows(rows: torch.Tensor, picked: Sequence[int]) -> torch.Tensor:
    """`rows[picked]`, gathered in one call, or `rows` itself when `picked` is every row in order."""
    if len(picked) == len(rows) and all(row == i for i, row in enumerate(picked)):
        return rows
    return rows.index_select(0, torch.tensor(picked, dtype=torch.long, device=rows.device))
