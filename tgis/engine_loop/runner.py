"""The batch-runner seam: what the loop core asks of a runner, and the parts both runners share.

A runner owns its engine, its sampler rows and its admission gates, and is the only place where a
request id turns into a tensor row. The core drives it: `select` (admission gates over the queue),
`add` (one admitted request), `schedule` and `execute` (one step, returning plain data keyed by id),
`release` (finished, failed or cancelled requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from engines.base import EngineSpec
from tgis.batching.admission import Selection
from tgis.engine_loop.results import BatchUsage, InputDetails, StepResult
from tgis.engine_loop.tasks import GenerationTask, ValidatedInput
from tgis.errors import Msg
from tgis.sampling import prompt_token_details


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

    def too_large(self, validated: ValidatedInput) -> str | None:
        """Why an input could never be admitted, even into an empty batch (None: it can be); reads only
        settings fixed at start, so any thread may ask."""
        ...

    def probe(self, input_ids: Sequence[int]) -> int:
        """The greedy next token of a one-off sequence, between steps (the health check)."""
        ...

    def usage(self) -> BatchUsage: ...

    def unload_loras(self, adapter_ids: Sequence[str]) -> None:
        """Free the engine's copy of adapters the store evicted, once no admitted task uses them."""
        ...


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
