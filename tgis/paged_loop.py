"""The engine loop over a paged engine: every step is schedule → execute → update on one flat batch.

Admission (SPEC §6.3, weights in KV blocks) moves queued requests into the planner, which takes
their longest cached prefix. Each step the planner picks the next token of every decoding sequence
plus prompt chunks under the step's token budget (`schedule`, plain data); the engine runs them as
one forward (`execute`); the sampler picks the decoding sequences' next tokens, which are
detokenized, checked against the stop rules and emitted, and finished sequences free their blocks
(`update`). `self._rows` holds the decoding sequences in the planner's decode order, which is
the order of the sampled logits and of the sampler's rows.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from engines.base import AdapterUnavailableError, Engine, LoraAdapter, PrefixEmbeddings
from engines.step import PagedEngine, SequenceChunk, StepBatch, StepOutput
from tgis.batching.blocks import BlockPool
from tgis.batching.paged import PagedPlanner, PagedSequence, StepPlan
from tgis.batching.prompt_budget import PromptBudget
from tgis.batching.scheduler import Scheduler, SequenceShape
from tgis.errors import Msg
from tgis.loop import EngineLoop, GenerationTask, RunningRow, failure_detail, failure_reason
from tgis.metrics import Metrics
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import FailureEvent, GenerationHealth, InputTokensEvent

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PagedRow(RunningRow):
    """A request in the planner, prefilling or decoding; `seq_id` names it there."""

    seq_id: int = -1
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # chunks so far, if asked for


class PagedEngineLoop(EngineLoop):
    """EngineLoop whose batch is a `PagedPlanner` over a `BlockPool` and whose engine steps flat."""

    def __init__(
        self,
        engine: PagedEngine,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        metrics: Metrics,
        pool: BlockPool,
        max_step_tokens: int,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_health: Callable[[GenerationHealth], None] | None = None,
        evicted_loras: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        # The padded Engine methods of the base class are never called: this loop overrides every
        # step; the base only reads `engine.spec`.
        super().__init__(
            cast(Engine, engine),
            tokenizer,
            scheduler,
            metrics,
            on_fatal=on_fatal,
            on_health=on_health,
            evicted_loras=evicted_loras,
        )
        self.paged = engine
        self.planner = PagedPlanner(pool, max_step_tokens)
        self.prompt_budget = PromptBudget()
        self._prefilling: dict[int, PagedRow] = {}
        self._seq_ids = itertools.count()
        self._pending_unloads: set[str] = set()

    # ---- admission -------------------------------------------------------------------------------

    def _running_tasks(self) -> list[GenerationTask]:
        return [row.task for row in self._rows] + [row.task for row in self._prefilling.values()]

    def _running_shapes(self) -> list[SequenceShape]:
        return self.planner.shapes()

    @property
    def running_count(self) -> int:
        return len(self.planner)

    def _has_work(self) -> bool:
        return len(self.planner) > 0

    def _min_group_size(self, running: int) -> int:
        return 1  # chunked prefill never stalls the running streams: admit as soon as blocks allow

    def _may_add_now(self) -> bool:
        return True

    def _prefill(self, group: list[GenerationTask]) -> None:
        """Admit the group into the planner; their prompts are computed by the next steps."""
        now = time.monotonic()
        for task in group:
            task.admitted_at = now
            self.metrics.request_queue_duration.observe(now - task.queued_at)
            try:
                self._admit(task)
            except AdapterUnavailableError as exc:  # only this request fails (SPEC §8)
                logger.error(f"Adapter {exc.adapter_id} could not be loaded at batch time: {exc}")
                self.metrics.request_failure.labels(err="generate").inc()
                detail = Msg.PREFIX_RETRIEVAL.format(id=exc.adapter_id)
                task.sink(FailureEvent(Msg.GENERATION_FAILED.format(detail=detail)))
        self.metrics.batch_current_size.set(len(self.planner))

    def _admit(self, task: GenerationTask) -> None:
        adapter = task.input.adapter
        if isinstance(adapter, LoraAdapter):
            self.paged.load_lora(adapter)
            self._pending_unloads.discard(adapter.adapter_id)
        prefix = len(self._virtual_prefix_ids(task))
        seq = PagedSequence(
            seq_id=next(self._seq_ids),
            token_ids=[self.engine.spec.pad_token_id] * prefix + list(task.input.input_ids),
            prompt_length=prefix + len(task.input.input_ids),
            max_new_tokens=task.input.max_new_tokens,
            cache_key=task.adapter_name,
        )
        # Input token details need the logits of every prompt position: nothing can come from the cache.
        lookup = self.planner.add(seq, use_cached=not self._wants_prompt_logits(task))
        self.metrics.prefix_cache_queries.inc(lookup.queried_tokens)
        self.metrics.prefix_cache_hits.inc(lookup.hit_tokens)
        self._prefilling[seq.seq_id] = PagedRow(task, self._tracker(task), seq_id=seq.seq_id)

    def _unload_evicted_loras(self) -> None:
        """Unload evicted adapters once no admitted sequence uses them."""
        if self._evicted_loras is not None:
            self._pending_unloads.update(self._evicted_loras())
        in_use = {task.adapter_id for task in self._running_tasks()}
        for adapter_id in self._pending_unloads - in_use:
            self.paged.unload_lora(adapter_id)
        self._pending_unloads &= in_use

    # ---- the step ------------------------------------------------------------------------------

    def _step(self) -> None:
        self._drop_cancelled_rows()
        if not len(self.planner):
            return
        started = time.monotonic()
        cap = self.prompt_budget.cap(len(self.planner.decode_order), self.planner.prefilling)
        plan = self.planner.plan(cap)  # schedule
        batch = self._step_batch(plan)
        method = "next_token" if not batch.prefill else "prefill"
        self.metrics.batch_inference_count.labels(method=method).inc()
        self.metrics.batch_inference_batch_size.labels(method=method).observe(len(plan.chunks))
        prompt_tokens = sum(len(chunk.token_ids) for chunk in batch.prefill)
        if prompt_tokens:  # computed by this step (nothing is padded)
            self.metrics.batch_next_tokens.observe(prompt_tokens)
        execute_started = time.monotonic()
        try:
            output = self.paged.step(batch)  # execute
        except Exception as exc:
            logger.exception("Step failed")
            self._set_health(GenerationHealth.FAILED)
            reason = failure_reason(exc)
            self.metrics.batch_inference_failure.labels(method=method, reason=reason).inc()
            if batch.prefill and reason != "oom":
                # New prompts are the likely cause: they fail, and the next step retries the running
                # streams alone (their tokens' keys and values are simply written again).
                self._fail_prefilling([chunk.seq_id for chunk in plan.chunks], failure_detail(exc))
            else:
                self._fail_rows(self._rows, failure_detail(exc), per_request=reason != "oom")
            return
        forward_done = time.monotonic()
        self.prompt_budget.observe(len(batch.decode) + prompt_tokens, forward_done - execute_started)
        self._update(plan, output)
        self._observe_step(method, len(plan.chunks), started, forward_done)
        self.metrics.batch_input_tokens.set(plan.tokens if len(self.planner) else 0)
        self.metrics.batch_current_size.set(len(self.planner))

    def _step_batch(self, plan: StepPlan) -> StepBatch:
        """The engine's view of the plan: token ids, positions, blocks and adapters of every chunk."""
        decode: list[SequenceChunk] = []
        prefill: list[SequenceChunk] = []
        for chunk in plan.chunks:
            seq = self.planner.sequence(chunk.seq_id)
            row = self._row(chunk.seq_id)
            adapter = row.task.input.adapter
            step_chunk = SequenceChunk(
                token_ids=tuple(seq.token_ids[chunk.start : chunk.start + chunk.length]),
                start=chunk.start,
                block_table=chunk.block_table,
                sample=chunk.samples,
                all_logits=chunk.start < seq.prompt_length and self._wants_prompt_logits(row.task),
                prefix=adapter if isinstance(adapter, PrefixEmbeddings) else None,
                lora=adapter if isinstance(adapter, LoraAdapter) else None,
            )
            (prefill if seq.prefilling else decode).append(step_chunk)
        return StepBatch(tuple(decode), tuple(prefill))

    def _row(self, seq_id: int) -> PagedRow:
        row = self._prefilling.get(seq_id)
        if row is not None:
            return row
        return next(row for row in self._decoding() if row.seq_id == seq_id)

    def _decoding(self) -> list[PagedRow]:
        return cast(list[PagedRow], self._rows)

    def _update(self, plan: StepPlan, output: StepOutput) -> None:
        """Sample the sequences whose newest token was computed, then detokenize, stop and emit."""
        for chunk, logits in zip(plan.chunks, output.chunk_logits, strict=True):
            if logits is not None and chunk.seq_id in self._prefilling:
                self._prefilling[chunk.seq_id].prompt_logits.append(logits)
        started = [self._prefilling.pop(seq_id) for seq_id in self.planner.computed(plan)]
        for row in started:
            if row.task.input.params.response.input_tokens:
                prompt = torch.cat(row.prompt_logits) if row.prompt_logits else None
                row.task.sink(InputTokensEvent(self._input_token_infos(row.task, prompt)))
                row.prompt_logits = []
        if started:
            self._sampler.add_rows(
                [row.task.input.sampling for row in started],
                [self._repetition_context(row.task) for row in started],
            )
            self._rows.extend(started)
            self._steps_since_prefill = 0
        sample = self._sampler.sample(output.logits)
        self._apply(self._rows, sample)
        for row, token_id in zip(self._decoding(), sample.token_ids, strict=True):
            self.planner.append_token(row.seq_id, token_id)
        self._steps_since_prefill += 1
        self._prune_finished()

    # ---- leaving the batch -----------------------------------------------------------------------

    def _drop_cancelled_rows(self) -> None:
        for seq_id, row in list(self._prefilling.items()):
            if row.task.cancelled:
                self.metrics.request_failure.labels(err="cancelled").inc()
                del self._prefilling[seq_id]
                self.planner.finish(seq_id)
        super()._drop_cancelled_rows()

    def _keep(self, indices: list[int]) -> None:
        kept = set(indices)
        for i, row in enumerate(self._decoding()):
            if i not in kept:
                self.planner.finish(row.seq_id)
        self._sampler.keep_rows(indices)
        self._rows = [self._rows[i] for i in indices]
        self.metrics.batch_current_size.set(len(self.planner))
        self._observe_kv_usage()

    def _fail_prefilling(self, seq_ids: Sequence[int], detail: str) -> None:
        """Fail the sequences among `seq_ids` still computing their prompt, and free their blocks."""
        for seq_id in seq_ids:
            row = self._prefilling.pop(seq_id, None)
            if row is not None:
                self.metrics.request_failure.labels(err="generate").inc()
                row.task.sink(FailureEvent(Msg.GENERATION_FAILED.format(detail=detail)))
                self.planner.finish(seq_id)
        self.metrics.batch_current_size.set(len(self.planner))
        self._observe_kv_usage()

    def _fail_rows(self, rows: Sequence[RunningRow], detail: str, *, per_request: bool = True) -> None:
        """Fail every admitted sequence, prefilling ones included, and free all their blocks."""
        everyone = [*self._rows, *self._prefilling.values()]
        for row in everyone:
            self.metrics.request_failure.labels(err="generate").inc()
            generated = row.tracker.generated_tokens
            own = Msg.ERROR_AFTER_TOKENS.format(count=generated, error=detail) if generated else detail
            row.task.sink(FailureEvent(Msg.GENERATION_FAILED.format(detail=own if per_request else detail)))
            self.planner.finish(cast(PagedRow, row).seq_id)
        self._rows = []
        self._prefilling = {}
        self._sampler = self._new_sampler()
        self.metrics.batch_current_size.set(0)
        self._observe_kv_usage()

    def _kv_usage_now(self) -> float:
        usage = self.planner.pool.usage()
        return usage.used / usage.total if usage.total else 0.0

    def _observe_kv_usage(self) -> None:
        super()._observe_kv_usage()
        usage = self.planner.pool.usage()
        for state, blocks in (("total", usage.total), ("used", usage.used), ("cached", usage.cached)):
            self.metrics.kv_cache_blocks.labels(state=state).set(blocks)

    # ---- health ----------------------------------------------------------------------------------

    def _probe_generation(self, input_ids: Sequence[int]) -> int:
        """A one-off sequence in blocks of its own (admission keeps them free), never cached."""
        pool = self.planner.pool
        blocks = pool.allocate(-(-len(input_ids) // pool.block_size))
        try:
            chunk = SequenceChunk(tuple(input_ids), 0, tuple(blocks), sample=True)
            return int(self.paged.step(StepBatch(prefill=(chunk,))).logits[0].argmax())
        finally:
            pool.free(blocks)
