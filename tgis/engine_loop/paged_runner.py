"""The paged batch runner: one flat step over KV blocks per iteration (schedule → execute, keyed by id).

Admission (SPEC §6.3, weights in KV blocks) moves a task into the planner, which takes its longest
cached prefix. `schedule` asks the planner for the next token of every decoding sequence plus prompt
chunks under the step's token budget (`PromptBudget`); `execute` runs them as one forward, samples
the sequences whose newest token was computed, and returns the tokens by task id. A task's id is its
sequence id in the planner, so no position is ever shared with the loop.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engines.step import PagedEngine, SequenceChunk, StepBatch, StepOutput
from tgis.batching.admission import Admission, Candidate, Selection, too_large
from tgis.batching.paged import PagedPlanner, PagedSequence, StepPlan
from tgis.batching.prompt_budget import PromptBudget
from tgis.engine_loop.beam_groups import BeamGroups
from tgis.engine_loop.beam_search import FinishedBeam
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.results import BatchUsage, InputDetails, RowFailure, StepResult, StepStats
from tgis.engine_loop.runner import (
    failure_detail,
    failure_reason,
    input_details,
    virtual_prefix_ids,
    wants_prompt_logits,
)
from tgis.engine_loop.sampled_rows import SampledRows, Verified, pick_rows
from tgis.engine_loop.speculation import Speculation
from tgis.engine_loop.tasks import GenerationTask, ValidatedInput

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Admitted:
    task: GenerationTask
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks so far, if asked for


@dataclass(frozen=True)
class PagedStep:
    """A scheduled step: the planner's plan, the engine's view of it, and whose chunk is whose there
    (`batch_ids[i]` owns `batch.chunks[i]`: decode chunks first, then prompt and draft chunks)."""

    plan: StepPlan
    batch: StepBatch
    batch_ids: tuple[int, ...]
    started: float

    @property
    def method(self) -> str:
        return "prefill" if self.prompt_tokens else "next_token"

    @property
    def prompt_tokens(self) -> int:
        return sum(chunk.length for chunk in self.plan.chunks if not chunk.decoding)

    @functools.cached_property  # read several times a step
    def drafts(self) -> dict[int, tuple[int, ...]]:
        return {chunk.seq_id: chunk.draft for chunk in self.plan.chunks if chunk.draft}

    def stats(self, forward_done: float, runs: Sequence[int] = ()) -> StepStats:
        return StepStats(
            method=self.method,
            batch_size=len(self.plan.chunks),
            prompt_tokens=self.prompt_tokens,
            started=self.started,
            forward_done=forward_done,
            input_tokens=self.plan.tokens,
            draft_tokens=sum(len(draft) for draft in self.drafts.values()),
            speculative_runs=tuple(runs),
        )


@dataclass(frozen=True)
class _DecodeCost:
    """A pure decode step whose cost is known once the next step begins: speculation's cost gate counts
    a step from its scheduling to the next one's, the emitted tokens' hand-off and stop rules included."""

    decoding: int
    speculated: bool
    tokens: int
    started: float


class PagedRunner:
    def __init__(
        self,
        engine: PagedEngine,
        admission: Admission,
        planner: PagedPlanner,
        eos_token_ids: Sequence[int],
        metrics: LoopMetrics,
        prompt_budget: PromptBudget | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        self.engine = engine
        self.spec = engine.spec
        self.admission = admission
        self.planner = planner
        self.prompt_budget = prompt_budget or PromptBudget()
        self.metrics = metrics
        self.speculation = speculation
        self._rows = SampledRows(engine.spec, eos_token_ids)
        self._beams = BeamGroups(planner, engine, eos_token_ids)
        self._admitted: dict[int, _Admitted] = {}
        self._pending_unloads: set[str] = set()
        self._last_decode: _DecodeCost | None = None

    @property
    def busy(self) -> bool:
        return len(self.planner) > 0

    # ---- admission ----------------------------------------------------------------------------------

    def select(self, waiting: Sequence[GenerationTask]) -> Selection:
        """Chunked prefill never stalls the running streams: admit as soon as the blocks allow."""
        candidates = [Candidate(self._beams.worst_shape(task.input), task.queued_at) for task in waiting]
        return self.admission.select(candidates, self._beams.running_shapes(), min_size=1)

    def too_large(self, validated: ValidatedInput) -> str | None:
        return too_large(self.admission.weights, self._beams.worst_shape(validated))

    def add(self, task: GenerationTask) -> None:
        if task.lora is not None:
            self.engine.load_lora(task.lora)  # AdapterUnavailableError: this task alone fails
            self._pending_unloads.discard(task.lora.adapter_id)
        prefix = len(virtual_prefix_ids(task, self.spec))
        sequence = PagedSequence(
            seq_id=task.id,
            token_ids=[self.spec.pad_token_id] * prefix + list(task.input.input_ids),
            prompt_length=prefix + len(task.input.input_ids),
            max_new_tokens=task.input.max_new_tokens,
            cache_key=task.adapter_name,
        )
        # Input token details need the logits of every prompt position: nothing can come from the cache.
        lookup = self.planner.add(sequence, use_cached=not wants_prompt_logits(task, self.spec))
        self.metrics.prefix_lookup(lookup.queried_tokens, lookup.hit_tokens)
        self._admitted[task.id] = _Admitted(task)
        if task.input.params.beam is not None:
            self._beams.start(task, self.spec, sequence.prompt_length)
        elif self.speculation is not None:
            self.speculation.start(task.id, task.input.input_ids)

    # ---- the step -----------------------------------------------------------------------------------

    def schedule(self) -> PagedStep | None:
        if not len(self.planner):
            return None
        started = time.monotonic()
        self._close_decode_cost(started)
        cap = self.prompt_budget.cap(len(self.planner.decode_order), self.planner.prefilling)
        drafts = {}
        if self.speculation is not None:
            order = self.planner.decode_order
            if len(self._beams):
                order = [seq_id for seq_id in order if not self._beams.owns(seq_id)]
            drafts = self.speculation.drafts(order, self.planner.prefilling > 0)
        plan = self.planner.plan(cap, drafts)
        batch, batch_ids = self._step_batch(plan)
        return PagedStep(plan, batch, batch_ids, started)

    def execute(self, plan: object) -> StepResult:
        assert isinstance(plan, PagedStep)
        execute_started = time.monotonic()
        try:
            output = self.engine.step(plan.batch)
        except Exception as exc:
            logger.exception("Step failed")
            return self._failed(plan, exc)
        forward_done = time.monotonic()
        if not plan.drafts:
            # A draft position costs more than a prompt token (its logits come back and are verified):
            # fitted as prompt tokens, they made prompts look dear and cut into many small chunks.
            decoding = sum(1 for chunk in plan.plan.chunks if chunk.decoding)
            self.prompt_budget.observe(plan.plan.tokens, forward_done - execute_started, decoding)
        return self._update(plan, output, forward_done)

    def _step_batch(self, plan: StepPlan) -> tuple[StepBatch, tuple[int, ...]]:
        """The engine's view of the plan: token ids, positions, blocks and adapters of every chunk. A
        decode chunk with a draft runs like a prompt chunk (several positions, causal over the cache),
        and all its positions' logits come back."""
        decode: list[tuple[int, SequenceChunk]] = []
        prefill: list[tuple[int, SequenceChunk]] = []
        for chunk in plan.chunks:
            sequence = self.planner.sequence(chunk.seq_id)
            task = self._admitted[self._beams.owner(chunk.seq_id)].task
            known = sequence.token_ids[chunk.start : chunk.start + chunk.length - len(chunk.draft)]
            prompt_logits = not chunk.decoding and wants_prompt_logits(task, self.spec)
            step_chunk = SequenceChunk(
                token_ids=(*known, *chunk.draft),
                start=chunk.start,
                block_table=chunk.block_table,
                sample=chunk.samples and not chunk.draft,
                all_logits=prompt_logits or bool(chunk.draft),
                prefix=task.prefix,
                lora=task.lora,
            )
            single_token = chunk.decoding and not chunk.draft
            (decode if single_token else prefill).append((chunk.seq_id, step_chunk))
        ordered = decode + prefill
        hidden = self.speculation is not None and self.speculation.wants_hidden
        batch = StepBatch(tuple(c for _, c in decode), tuple(c for _, c in prefill), hidden=hidden)
        return batch, tuple(task_id for task_id, _ in ordered)

    def _update(self, step: PagedStep, output: StepOutput, forward_done: float) -> StepResult:
        """Sample the sequences whose newest token was computed (verifying drafts); start sampling the
        prompts this step completed."""
        drafts = step.drafts
        # Each sampling sequence's rows of the logits: its draft's and the one before, or its last.
        rows_of: dict[int, range] = {}
        for task_id, chunk, rows in zip(step.batch_ids, step.batch.chunks, output.chunk_rows, strict=True):
            if task_id in drafts:
                rows_of[task_id] = rows
                continue
            if chunk.all_logits:  # a prompt chunk asked for its input token details
                self._admitted[task_id].prompt_logits.append(output.logits[rows.start : rows.stop])
            if chunk.sample:
                rows_of[task_id] = rows[-1:]
        details: dict[int, InputDetails] = {}
        failed: dict[int, RowFailure] = {}
        for task_id in self.planner.computed(step.plan):  # prompts now complete, in plan order
            self._start_sampling(self._admitted[task_id], details, failed)
        beams = self._advance_beams(output, rows_of, failed) if len(self._beams) else {}
        if drafts:
            verified = self._rows.verify(output.logits, rows_of, drafts)
        else:  # one token each: one sample of the whole batch
            row_of = {task_id: rows[0] for task_id, rows in rows_of.items()}
            sampled, finished = self._rows.sample_rows(output.logits, row_of)
            verified = Verified({task_id: [token] for task_id, token in sampled.items()}, finished)
        runs = []
        states = self._newest_states(output, rows_of, verified)
        for task_id, tokens in verified.tokens.items():
            accepted = verified.accepted(task_id)
            token_ids = [token.token_id for token in tokens]
            self.planner.append_tokens(task_id, token_ids, accepted)
            if self.speculation is not None:
                proposed = len(drafts.get(task_id, ()))
                self.speculation.record(task_id, token_ids, proposed, accepted, states.get(task_id))
            if task_id in drafts:
                runs.append(len(tokens))
        self._observe_cost(step, verified)
        return StepResult(
            stats=step.stats(forward_done, runs),
            tokens={task_id: tuple(tokens) for task_id, tokens in verified.tokens.items()},
            input_details=details,
            guide_finished=frozenset(verified.guide_finished),
            failed=failed,
            beams=beams,
        )

    def _advance_beams(
        self, output: StepOutput, rows_of: dict[int, range], failed: dict[int, RowFailure]
    ) -> dict[int, tuple[FinishedBeam, ...]]:
        """Take the beam requests' rows out of `rows_of` and step their searches; a search that fails
        fails its request alone."""
        beam_rows = {seq_id: rows_of.pop(seq_id) for seq_id in list(rows_of) if self._beams.owns(seq_id)}
        if not beam_rows:
            return {}
        try:
            ended = self._beams.advance(output.logits, beam_rows)
        except Exception as exc:
            logger.exception("Beam search step failed")
            for task_id in {self._beams.owner(seq_id) for seq_id in beam_rows}:
                failed[task_id] = RowFailure(f"beam search: {exc}")
            return {}
        return {task_id: tuple(found) for task_id, found in ended.items()}

    def _observe_cost(self, step: PagedStep, verified: Verified) -> None:
        """A pure decode step's tokens, for speculation's cost gate; its seconds run until the next step."""
        self._last_decode = None
        if self.speculation is not None and not step.prompt_tokens:
            emitted = sum(len(tokens) for tokens in verified.tokens.values())
            self._last_decode = _DecodeCost(len(step.batch_ids), bool(step.drafts), emitted, step.started)

    def _close_decode_cost(self, now: float) -> None:
        """The last pure decode step's seconds, from its scheduling (before the proposal) until now."""
        last, self._last_decode = self._last_decode, None
        if last is not None and self.speculation is not None:
            self.speculation.observe_step(last.decoding, last.speculated, now - last.started, last.tokens)

    @staticmethod
    def _newest_states(
        output: StepOutput, rows_of: Mapping[int, range], verified: Verified
    ) -> dict[int, torch.Tensor]:
        """Each sequence's final hidden state at the position that produced its newest token (its last
        accepted draft token's, else the one before the draft), when the step asked for hidden states.
        One indexing call picks them all: a few tensor calls per sequence would each wait for the GIL
        behind the event loop (tgis/speculation/gate.py)."""
        if output.hidden is None or not verified.tokens:
            return {}
        task_ids = list(verified.tokens)
        rows = [rows_of[task_id][verified.accepted(task_id)] for task_id in task_ids]
        return dict(zip(task_ids, pick_rows(output.hidden, rows).unbind(), strict=True))

    def _start_sampling(
        self, admitted: _Admitted, details: dict[int, InputDetails], failed: dict[int, RowFailure]
    ) -> None:
        """A prompt is complete: its input token details, then its sampler row (either can fail it alone)."""
        task = admitted.task
        try:
            if task.input.params.response.input_tokens:
                prompt = torch.cat(admitted.prompt_logits) if admitted.prompt_logits else None
                details[task.id] = input_details(task, self.spec, prompt)
            admitted.prompt_logits = []
            if task.input.params.beam is None:
                self._rows.add(task)
        except Exception as exc:
            logger.exception(f"Request {task.id} could not start sampling")
            failed[task.id] = RowFailure(str(exc))

    def _failed(self, step: PagedStep, exc: Exception) -> StepResult:
        """New prompts are the likely cause of a failed forward: they fail, and the next step retries the
        running streams alone (their tokens' keys and values are simply written again). Out of memory,
        or a step of decodes only (drafts included: they ride as chunks but are no prompt), fails everyone
        admitted."""
        reason = failure_reason(exc)
        detail = failure_detail(exc)
        prefilling = [chunk.seq_id for chunk in step.plan.chunks if not chunk.decoding]
        if prefilling and reason != "oom":
            failed = {task_id: RowFailure(detail) for task_id in prefilling}
        else:
            failed = {task_id: RowFailure(detail, per_request=reason != "oom") for task_id in self._admitted}
        return StepResult(stats=step.stats(time.monotonic()), failed=failed, engine_error=reason)

    # ---- leaving ------------------------------------------------------------------------------------

    def release(self, task_ids: Iterable[int]) -> None:
        gone = [task_id for task_id in task_ids if task_id in self._admitted]
        for task_id in gone:
            self.planner.finish(task_id)
            del self._admitted[task_id]
        self._beams.release(gone)
        self._rows.remove(gone)
        if self.speculation is not None:
            self.speculation.stop(gone)
        if not len(self.planner):
            # The loop waits for work before the next step: the last step's cost ends here, not after.
            self._close_decode_cost(time.monotonic())

    def tracked(self) -> dict[str, int]:
        """How many requests each part of the runner holds state for: its admitted map, the planner's
        sequences (their KV blocks), the sampler rows and speculation's per-sequence state. Each part
        owns its map; `release` is the one place that empties all four, and the loop's tests check
        that every way a request ends leaves them empty."""
        return {
            "admitted": len(self._admitted),
            "planner": len(self.planner),
            "sampler_rows": len(self._rows),
            "speculation": 0 if self.speculation is None else len(self.speculation),
            "beam_searches": len(self._beams),
        }

    def unload_loras(self, adapter_ids: Sequence[str]) -> None:
        """Unload evicted adapters once no admitted sequence uses them."""
        self._pending_unloads.update(adapter_ids)
        in_use = {a.task.lora.adapter_id for a in self._admitted.values() if a.task.lora is not None}
        for adapter_id in self._pending_unloads - in_use:
            self.engine.unload_lora(adapter_id)
        self._pending_unloads &= in_use

    # ---- load and health ----------------------------------------------------------------------------

    def usage(self) -> BatchUsage:
        blocks = self.planner.pool.usage()
        return BatchUsage(
            admitted=len(self.planner),
            kv_cache_usage=blocks.used / blocks.total if blocks.total else 0.0,
            blocks_total=blocks.total,
            blocks_used=blocks.used,
            blocks_cached=blocks.cached,
        )

    def probe(self, input_ids: Sequence[int]) -> int:
        """A one-off sequence in blocks of its own (admission keeps them free), never cached."""
        pool = self.planner.pool
        blocks = pool.allocate(-(-len(input_ids) // pool.block_size))
        try:
            chunk = SequenceChunk(tuple(input_ids), 0, tuple(blocks), sample=True)
            return int(self.engine.step(StepBatch(prefill=(chunk,))).logits[0].argmax())
        finally:
            pool.free(blocks)
