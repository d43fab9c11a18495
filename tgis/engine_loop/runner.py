"""The batch-runner seam: what the loop core asks of a runner, and the parts both runners share.

A runner owns its engine, its sampler rows and its admission gates, and is the only place where a
request id turns into a tensor row. The core drives it: `select` (admission gates over the queue),
`add` (one admitted request), `schedule` and `execute` (one step, returning plain data keyed by id),
`release` (finished, failed or cancelled requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import torch

from engines.base import EngineSpec
from tgis.batching.admission import Selection
from tgis.engine_loop.results import BatchUsage, InputDetails, SampledToken, StepResult
from tgis.engine_loop.tasks import GenerationTask
from tgis.errors import Msg
from tgis.sampling import BatchSampler, prompt_token_details


class BatchRunner(Protocol):
    @property
    def busy(self) -> bool:
        """Whether a step has something to compute."""
        ...

    def select(self, waiting: Sequence[GenerationTask]) -> Selection:
        """Which queued tasks may join now (positions in `waiting`), under the runner's gates."""
        ...

    def add(self, task: GenerationTask) -> None:
        """Admit one task; raises (changing nothing) if this task alone cannot be served."""
        ...

    def schedule(self) -> object | None:
        """The next step's plan, or None when there is nothing to compute."""
        ...

    def execute(self, plan: object) -> StepResult:
        """Run a planned step; engine failures come back in the result, not as exceptions."""
        ...

    def release(self, task_ids: Iterable[int]) -> None:
        """Forget these tasks and free what they hold (unknown ids are ignored)."""
        ...

    def probe(self, input_ids: Sequence[int]) -> int:
        """The greedy next token of a one-off sequence, between steps (the health check)."""
        ...

    def usage(self) -> BatchUsage: ...

    def unload_loras(self, adapter_ids: Sequence[str]) -> None:
        """Free the engine's copy of adapters the store evicted, once no admitted task uses them."""
        ...


class SampledRows:
    """The sampler's rows, addressed by task id: the runners' one map from a request to its row."""

    def __init__(self, spec: EngineSpec, eos_token_ids: Sequence[int]) -> None:
        self._spec = spec
        self._eos = tuple(eos_token_ids)
        self.sampler = BatchSampler(spec.vocab_size, self._eos, spec.device)
        self.ids: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, task: GenerationTask) -> None:
        """A row for `task` after the others; raises, changing nothing, if the sampler refuses it."""
        context = () if self._spec.is_encoder_decoder else task.input.input_ids
        self.sampler.add_rows([task.input.sampling], [context])
        self.ids.append(task.id)

    def remove(self, task_ids: Iterable[int]) -> None:
        gone = set(task_ids)
        keep = [i for i, task_id in enumerate(self.ids) if task_id not in gone]
        if len(keep) != len(self.ids):
            self.sampler.keep_rows(keep)
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
        sample = self.sampler.sample(pick_rows(logits, [row_of[task_id] for task_id in self.ids]))
        tokens = {
            task_id: SampledToken(token_id, detail)
            for task_id, token_id, detail in zip(self.ids, sample.token_ids, sample.details, strict=True)
        }
        return tokens, {self.ids[position] for position in sample.guide_finished}

    def extend(self, other: SampledRows) -> None:
        """Append another set's rows (a prefilled group joining the running batch) after these."""
        self.sampler.extend(other.sampler)
        self.ids += other.ids

    def clear(self) -> None:
        self.sampler = BatchSampler(self._spec.vocab_size, self._eos, self._spec.device)
        self.ids = []


def pick_rows(rows: torch.Tensor, picked: Sequence[int]) -> torch.Tensor:
    """`rows[picked]`, gathered in one call, or `rows` itself when `picked` is every row in order."""
    if len(picked) == len(rows) and all(row == i for i, row in enumerate(picked)):
        return rows
    return rows.index_select(0, torch.tensor(picked, dtype=torch.long, device=rows.device))


def wants_prompt_logits(task: GenerationTask, spec: EngineSpec) -> bool:
    """Input token details need the logits of every prompt position (decoder-only models)."""
    response = task.input.params.response
    return response.input_tokens and response.input_scores and not spec.is_encoder_decoder


def virtual_prefix_ids(task: GenerationTask, spec: EngineSpec) -> tuple[int, ...]:
    """Prefix positions in input token details, reported as the pad token (SPEC §15 #7, as TGIS does)."""
    prefix = task.prefix
    if prefix is None:
        return ()
    virtual = prefix.encoder if spec.is_encoder_decoder else prefix.decoder
    return (spec.pad_token_id,) * (0 if virtual is None else int(virtual.shape[0]))


def input_details(task: GenerationTask, spec: EngineSpec, prompt_logits: torch.Tensor | None) -> InputDetails:
    """The prompt's input token details from its logits (None: encoder-decoder, or no scores asked for:
    the tokens only)."""
    ids = virtual_prefix_ids(task, spec) + task.input.input_ids
    if prompt_logits is None:
        return InputDetails(ids, None)
    response = task.input.params.response
    details = prompt_token_details(
        prompt_logits,
        ids,
        want_logprobs=response.token_logprobs,
        want_ranks=response.token_ranks,
        top_n=response.top_n_tokens,
    )
    return InputDetails(ids, tuple(details))


def failure_reason(exc: BaseException) -> str:
    return "oom" if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower() else "error"


def failure_detail(exc: BaseException) -> str:
    return Msg.GPU_OUT_OF_MEMORY if failure_reason(exc) == "oom" else str(exc)
