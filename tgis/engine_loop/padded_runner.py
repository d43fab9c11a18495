"""The padded batch runner: TGIS's dynamic batching over an engine whose rows are padded sequences.

A selected group is prefilled in one forward and merges into the running batch; otherwise every
running row decodes one token (SPEC §6.2). Admission waits for a group large enough to justify
interrupting the decodes, and for the prefill cool-down. The engine and the sampler address rows by
position; this runner keeps their order in `_ids` and is the only place that translates.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from engines.base import AdapterUnavailableError, Engine, PrefillRow
from tgis.batching.admission import Admission, Candidate, Selection, SequenceShape, too_large
from tgis.engine_loop.beam_search import FinishedBeam
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.padded_beams import PaddedBeams
from tgis.engine_loop.results import BatchUsage, InputDetails, RowFailure, SampledToken, StepResult, StepStats
from tgis.engine_loop.runner import (
    failure_detail,
    failure_reason,
    input_details,
    wants_prompt_logits,
)
from tgis.engine_loop.sampled_rows import SampledRows
from tgis.engine_loop.tasks import GenerationTask, ValidatedInput
from tgis.errors import Msg

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prefill:
    group: tuple[GenerationTask, ...]
    started: float


@dataclass(frozen=True)
class Decode:
    started: float


class PaddedRunner:
    def __init__(
        self, engine: Engine, admission: Admission, eos_token_ids: Sequence[int], metrics: LoopMetrics
    ) -> None:
        self.engine = engine
        self.spec = engine.spec
        self.admission = admission
        self.metrics = metrics
        self._eos = tuple(eos_token_ids)
        self._ids: list[int] = []  # engine rows' keys, in order: task ids, and beam rows' own keys
        self._rows = SampledRows(engine.spec, eos_token_ids)  # sampler rows (the same ids)
        self._beams = PaddedBeams(engine.spec, eos_token_ids)
        self._tasks: dict[int, GenerationTask] = {}
        self._generated: dict[int, int] = {}
        self._last: dict[int, int] = {}  # each running row's newest token, the next decode's input (by key)
        self._joining: list[GenerationTask] = []
        self._steps_since_prefill = 0
        self._cooldown_until = 0.0

    @property
    def busy(self) -> bool:
        return bool(self._ids or self._joining)

    # ---- admission ----------------------------------------------------------------------------------

    def select(self, waiting: Sequence[GenerationTask]) -> Selection:
        """SPEC §6.2 b: add only while R ≥ 2 and the cool-down has passed, in a group large enough."""
        running = self._shapes()
        if running and not self._may_add_now():
            return Selection()
        size = self.admission.min_group_size(len(running), self._steps_since_prefill) if running else 1
        candidates = [Candidate(_worst_shape(task.input), task.queued_at) for task in waiting]
        return self.admission.select(candidates, running, size)

    def too_large(self, validated: ValidatedInput) -> str | None:
        return too_large(self.admission.weights, _worst_shape(validated))

    def add(self, task: GenerationTask) -> None:
        self._tasks[task.id] = task
        self._joining.append(task)

    def _shapes(self) -> list[SequenceShape]:
        owners = [self._beams.owner(key) for key in self._ids]
        return [self._tasks[i].shape(self._generated[i]) for i in owners]

    def _may_add_now(self) -> bool:
        owners = [self._beams.owner(key) for key in self._ids]
        remaining = sum(self._tasks[i].input.max_new_tokens - self._generated[i] for i in owners)
        self.metrics.remaining_tokens(remaining)
        return remaining >= 2 and time.monotonic() >= self._cooldown_until

    # ---- the step -----------------------------------------------------------------------------------

    def schedule(self) -> Prefill | Decode | None:
        if self._joining:
            group, self._joining = tuple(self._joining), []
            return Prefill(group, time.monotonic())
        return Decode(time.monotonic()) if self._ids else None

    def execute(self, plan: object) -> StepResult:
        if isinstance(plan, Prefill):
            return self._prefill(plan)
        assert isinstance(plan, Decode)
        return self._decode(plan)

    def _prefill(self, plan: Prefill) -> StepResult:
        group = plan.group
        rows = [task.prefill_row(wants_prompt_logits(task, self.spec)) for task in group]
        joined = bool(self._ids)
        stats = StepStats(
            method="prefill",
            batch_size=len(group),
            prompt_tokens=len(group) * max(task.shape().input_length for task in group),
            started=plan.started,
            forward_done=plan.started,
            joined=joined,
        )
        try:
            result = self.engine.prefill(rows)
        except AdapterUnavailableError as exc:  # only the tasks using that adapter fail (SPEC §8)
            return self._without_adapter(plan, exc)
        except Exception as exc:
            logger.exception("Prefill failed")
            everyone = {task.id: RowFailure(failure_detail(exc), per_request=False) for task in group}
            return StepResult(stats=stats, failed=everyone, engine_error=failure_reason(exc))
        forward_done = time.monotonic()
        self._ids += [task.id for task in group]
        joining = SampledRows(self.spec, self._eos)
        failed: dict[int, RowFailure] = {}
        details: dict[int, InputDetails] = {}
        for task, prompt_logits in zip(group, result.prompt_logits, strict=True):
            self._generated[task.id] = 0
            try:
                if task.input.params.response.input_tokens:
                    details[task.id] = input_details(task, self.spec, prompt_logits)
                if task.input.params.beam is None:
                    joining.add(task)
                else:
                    self._beams.start(task)
            except Exception as exc:
                logger.exception(f"Request {task.id} could not start sampling")
                failed[task.id] = RowFailure(str(exc))
        # The new rows are sampled on their own, then merged, just as the engine merged their cache.
        sampled, guide_finished = joining.sample(result.next_token_logits, [task.id for task in group])
        self._rows.extend(joining)
        self._took(sampled)
        ended = self._advance_beams(result.next_token_logits, {t.id: i for i, t in enumerate(group)})
        self._steps_since_prefill = 1
        done = time.monotonic()
        self._cooldown_until = done + (done - plan.started) / 2
        stats = replace(stats, forward_done=forward_done, input_tokens=self._input_tokens())
        return StepResult(stats, _one_each(sampled), details, frozenset(guide_finished), failed, beams=ended)

    def _advance_beams(
        self, logits: torch.Tensor, row_of: dict[int, int]
    ) -> dict[int, tuple[FinishedBeam, ...]]:
        """Step the beam searches whose rows have logits (`row_of`: row key → its row of `logits`), then
        copy and drop the batch's rows as they continue."""
        if not len(self._beams):
            return {}
        layout = self._beams.advance(logits, row_of, self._ids)
        if layout.changes:
            self.engine.keep_rows(layout.rows)
            for key in set(self._ids) - set(layout.keys):
                self._last.pop(key, None)
            self._ids = layout.keys
        self._last.update(layout.next_tokens)
        for task_id in {*layout.ended, *map(self._beams.owner, layout.next_tokens)}:
            self._generated[task_id] = self._beams.generated(task_id)
        return {task_id: tuple(beams) for task_id, beams in layout.ended.items()}

    def _without_adapter(self, plan: Prefill, exc: AdapterUnavailableError) -> StepResult:
        """Fail the group's tasks that use the adapter that could not load; prefill the rest."""
        logger.error(f"Adapter {exc.adapter_id} could not be loaded at batch time: {exc}")
        uses = [
            task for task in plan.group if task.lora is not None and task.lora.adapter_id == exc.adapter_id
        ]
        detail = Msg.PREFIX_RETRIEVAL.format(id=exc.adapter_id)
        failed = {task.id: RowFailure(detail, per_request=False) for task in uses}
        rest = tuple(task for task in plan.group if task not in uses)
        if not rest or len(rest) == len(plan.group):
            return StepResult(failed=failed)
        result = self._prefill(Prefill(rest, plan.started))
        return StepResult(
            result.stats,
            result.tokens,
            result.input_details,
            result.guide_finished,
            {**result.failed, **failed},
            result.engine_error,
            result.beams,
        )

    def _decode(self, plan: Decode) -> StepResult:
        stats = StepStats("next_token", len(self._ids), 0, plan.started, plan.started, self._input_tokens())
        try:
            logits = self.engine.decode([self._last[i] for i in self._ids])
        except Exception as exc:
            logger.exception("Next-token step failed")
            reason = failure_reason(exc)
            owners = dict.fromkeys(self._beams.owner(key) for key in self._ids)
            failed = {i: RowFailure(failure_detail(exc), per_request=reason != "oom") for i in owners}
            return StepResult(stats=stats, failed=failed, engine_error=reason)
        forward_done = time.monotonic()
        sampled, guide_finished = self._rows.sample(logits, self._ids)
        self._took(sampled)
        ended = self._advance_beams(logits, {key: row for row, key in enumerate(self._ids)})
        self._steps_since_prefill += 1
        stats = StepStats("next_token", len(self._ids), 0, plan.started, forward_done, self._input_tokens())
        return StepResult(stats, _one_each(sampled), guide_finished=frozenset(guide_finished), beams=ended)

    def _took(self, sampled: dict[int, SampledToken]) -> None:
        for task_id, token in sampled.items():
            self._last[task_id] = token.token_id
            self._generated[task_id] += 1

    def _input_tokens(self) -> int:
        """Padded batch: every row is as long as the longest one."""
        lengths = [shape.input_length for shape in self._shapes()]
        return max(lengths, default=0) * len(lengths)

    # ---- leaving ------------------------------------------------------------------------------------

    def release(self, task_ids: Iterable[int]) -> None:
        gone = {task_id for task_id in task_ids if task_id in self._tasks}
        if not gone:
            return
        self._joining = [task for task in self._joining if task.id not in gone]
        keep = [i for i, key in enumerate(self._ids) if self._beams.owner(key) not in gone]
        if len(keep) != len(self._ids):
            if keep:
                self.engine.keep_rows(keep)
            else:
                self.engine.clear()
            kept = [self._ids[i] for i in keep]
            for key in set(self._ids) - set(kept):  # a beam request's rows have keys of their own
                self._last.pop(key, None)
            self._ids = kept
        self._rows.remove(gone)
        for task_id in gone:
            self._beams.release(task_id)
            del self._tasks[task_id]
            self._generated.pop(task_id, None)
            self._last.pop(task_id, None)

    def tracked(self) -> dict[str, int]:
        """How many requests (or rows) each part of the runner holds state for; all 0 once every
        request has left, however it ended."""
        return {
            "tasks": len(self._tasks),
            "rows": len(self._ids),
            "sampler_rows": len(self._rows),
            "next_tokens": len(self._last),
            "beam_searches": len(self._beams),
        }

    def unload_loras(self, adapter_ids: Sequence[str]) -> None:
        """The padded engine defers unloading an adapter a running row still uses."""
        for adapter_id in adapter_ids:
            self.engine.unload_lora(adapter_id)

    # ---- load and health ----------------------------------------------------------------------------

    def usage(self) -> BatchUsage:
        """The running batch's share of the memory model's capacity (of MAX_BATCH_SIZE without one)."""
        weights = self.admission.weights
        if math.isinf(weights.max_weight) or weights.max_weight <= 0:
            share = len(self._ids) / self.admission.max_batch_size
        else:
            share = min(1.0, weights.initial(self._shapes()) / weights.max_weight)
        return BatchUsage(admitted=len(self._tasks), kv_cache_usage=share)

    def probe(self, input_ids: Sequence[int]) -> int:
        """Prefill the probe as an extra row, take its greedy token, then drop the row again."""
        running = len(self._ids)
        try:
            result = self.engine.prefill([PrefillRow(input_ids)])
            return int(result.next_token_logits[-1].argmax())
        finally:
            self.engine.keep_rows(list(range(running)))


def _worst_shape(validated: ValidatedInput) -> SequenceShape:
    """Admission's view of an input: a beam request holds a row per beam, each as long as the prompt
    and its tokens."""
    plain, beam = validated.shape(), validated.params.beam
    if beam is None:
        return plain
    prompt, new = plain.input_length, plain.remaining_new_tokens
    return SequenceShape(prompt, new + (beam.width - 1) * (prompt + new))


def _one_each(sampled: dict[int, SampledToken]) -> dict[int, tuple[SampledToken, ...]]:
    return {task_id: (token,) for task_id, token in sampled.items()}
