"""The engine-loop thread: admits queued requests, steps the batch, samples, stops, and emits events."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from engines.base import AdapterUnavailableError, Engine, LoraAdapter, PrefillRow, PrefixEmbeddings
from tgis.api.validation import ValidatedInput
from tgis.batching.scheduler import Candidate, Scheduler, SequenceShape
from tgis.errors import GenerationError, Msg, OverloadedError
from tgis.metrics import Metrics
from tgis.sampling import BatchSampler, StepSample, prompt_token_details
from tgis.stopping import OutputTracker, StopCriteria, TokenOutcome
from tgis.tokenization.detokenizer import for_tokenizer
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import (
    FailureEvent,
    GenerationEvent,
    GenerationHealth,
    InputTokensEvent,
    StopReason,
    TokenDetail,
    TokenEvent,
    TokenInfo,
)

logger = logging.getLogger(__name__)

EventSink = Callable[[GenerationEvent], None]
MAX_QUEUE_SIZE = 10_000
IDLE_WAIT_SECONDS = 1.0


@dataclass(eq=False)
class GenerationTask:
    """One validated input travelling from the servicer to the loop; `cancelled` is set by the servicer."""

    input: ValidatedInput
    arrival: float
    sink: EventSink
    cancelled: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    # Set by the loop thread before the event that reports them (for request logs and traces).
    admitted_at: float | None = None
    finished_at: float | None = None

    @property
    def deadline(self) -> float | None:
        millis = self.input.params.stopping.time_limit_millis
        return self.arrival + millis / 1000 if millis > 0 else None

    def shape(self, generated: int = 0) -> SequenceShape:
        """Batch accounting: the prefix counts as input (SPEC §8), generated tokens as input so far."""
        length = len(self.input.input_ids) + self.input.prefix_length + generated
        return SequenceShape(length, self.input.max_new_tokens - generated)

    @property
    def adapter_id(self) -> str | None:
        adapter = self.input.adapter
        return adapter.adapter_id if isinstance(adapter, LoraAdapter) else None

    @property
    def adapter_name(self) -> str | None:
        """The id the request named its adapter by (LoRA or prompt-tuning prefix), if any."""
        return self.input.adapter_name

    def prefill_row(self, want_prompt_logits: bool) -> PrefillRow:
        adapter = self.input.adapter
        return PrefillRow(
            self.input.input_ids,
            want_prompt_logits=want_prompt_logits,
            prefix=adapter if isinstance(adapter, PrefixEmbeddings) else None,
            lora=adapter if isinstance(adapter, LoraAdapter) else None,
        )


@dataclass(frozen=True)
class LoopLoad:
    """What the loop carries right now, for load gauges that gateways and autoscalers read."""

    waiting: int  # requests queued, not yet admitted
    running: int  # requests in the running batch
    kv_cache_usage: float  # 0-1: the share of the KV-cache capacity the running batch holds
    running_adapters: tuple[str, ...]  # adapter ids (LoRA or prefix) of running requests, distinct
    waiting_adapters: tuple[str, ...]  # adapter ids of queued requests, distinct


@dataclass(eq=False)
class _Probe:
    """A health-check generation waiting for the loop thread; the future gets the greedy token."""

    input_ids: Sequence[int]
    result: Future[int] = field(default_factory=Future)


@dataclass(eq=False)
class RunningRow:
    """A request in the running batch; its position in `EngineLoop._rows` is its engine row."""

    task: GenerationTask
    tracker: OutputTracker
    last_token: int = -1
    failed: bool = False  # failed on its own (detokenization); pruned with the finished rows


class EngineLoop:
    """Owns the engine from one thread; the asyncio side only submits tasks and reads events."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_health: Callable[[GenerationHealth], None] | None = None,
        evicted_loras: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.metrics = metrics
        self._on_fatal = on_fatal
        self._on_health = on_health
        self._evicted_loras = evicted_loras  # the adapter store's evictions, unloaded from the engine here
        # Written only by the loop thread; every forward pass (requests and health probes) updates it.
        self.generation_health = GenerationHealth.UNKNOWN
        self._probes: list[_Probe] = []
        self._queue: deque[GenerationTask] = deque()
        self._cond = threading.Condition()
        self._rows: list[RunningRow] = []
        self._sampler = self._new_sampler()
        self._steps_since_prefill = 0
        self._prefill_cooldown_until = 0.0
        self._stopping = False
        self._kv_cache_usage = 0.0  # written by the loop thread after every step
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- asyncio side -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def submit(self, tasks: Sequence[GenerationTask]) -> None:
        with self._cond:
            if self._stopping or not self.alive:  # nothing would ever answer these
                raise GenerationError(Msg.GENERATION_FAILED.format(detail="the batching loop is not running"))
            if len(self._queue) + len(tasks) > MAX_QUEUE_SIZE:
                self.metrics.request_failure.labels(err="queue_full").inc()
                raise OverloadedError(Msg.QUEUE_FULL)
            self._queue.extend(tasks)
            self.metrics.queue_size.set(len(self._queue))
            self._cond.notify_all()

    def probe(self, input_ids: Sequence[int]) -> Future[int]:
        """A 1-token greedy generation that bypasses the queue but runs between forward passes."""
        probe = _Probe(input_ids)
        with self._cond:
            if self._stopping or not self.alive:
                probe.result.set_exception(RuntimeError("the engine loop is not running"))
            else:
                self._probes.append(probe)
                self._cond.notify_all()
        return probe.result

    @property
    def generation_healthy(self) -> bool:
        return self.generation_health == GenerationHealth.HEALTHY

    @property
    def running_count(self) -> int:
        return len(self._rows)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def load(self) -> LoopLoad:
        """A snapshot of the queue and the running batch; safe to call from any thread."""
        with self._cond:
            waiting = list(self._queue)
        running = self._running_tasks()
        return LoopLoad(
            waiting=len(waiting),
            running=len(running),
            kv_cache_usage=self._kv_cache_usage,
            running_adapters=_distinct_adapter_ids(running),
            waiting_adapters=_distinct_adapter_ids(waiting),
        )

    # ---- engine-loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        group: list[GenerationTask] | None = []
        try:
            while True:
                group = self._next_group()
                if group is None:
                    return
                self._run_probes()
                self._unload_evicted_loras()
                if group:
                    self._prefill(group)
                if self._has_work():
                    self._step()
        except BaseException as exc:  # the loop must never die silently
            logger.exception("The batching loop crashed")
            if self._on_fatal is not None:
                self._on_fatal(exc)
            self._abandon_tasks(group or [], "batching loop crashed")
        finally:
            self._abandon_probes()

    def _unload_evicted_loras(self) -> None:
        """Free the engine's copy of LoRA adapters the store evicted (the engine defers ones in use)."""
        if self._evicted_loras is not None:
            for adapter_id in self._evicted_loras():
                self.engine.unload_lora(adapter_id)

    def _abandon_tasks(self, group: list[GenerationTask], detail: str) -> None:
        """After a crash: fail every request still waiting (running, being prefilled, queued) so that
        no client hangs; the engine is not touched, it may be what failed."""
        tasks = self._running_tasks()
        tasks += [task for task in group if all(task is not known for known in tasks)]
        with self._cond:
            self._stopping = True  # from now on `submit` refuses instead of queueing for nobody
            tasks += self._queue
            self._queue.clear()
        self._rows = []
        for task in tasks:
            self.metrics.request_failure.labels(err="generate").inc()
            task.sink(FailureEvent(Msg.GENERATION_FAILED.format(detail=detail)))

    def _next_group(self) -> list[GenerationTask] | None:
        """Wait for work, then pick the group to prefill now (maybe empty); None once stopping."""
        with self._cond:
            while True:
                self._expire_queued(deadlines=False)
                if self._stopping:
                    return None
                if self._has_work() or self._queue or self._probes:
                    break
                self._cond.wait(self._idle_wait())
            group = self._select_group() if self._queue and self._may_add_now() else []
            # Deadlines count only for entries that missed this admission: an admitted request
            # always yields at least one token, even with a 1 ms limit (SPEC §5.6).
            self._expire_queued(deadlines=True)
            return group

    def _select_group(self) -> list[GenerationTask]:
        """Dequeue the group the scheduler picks (SPEC §6.2-§6.3); called with the lock held."""
        running = self._running_shapes()
        min_size = self._min_group_size(len(running))
        waiting = [Candidate(task.shape(), task.queued_at) for task in self._queue]
        selection = self.scheduler.select(waiting, running, min_size)
        chosen = set(selection.indices)
        group = [task for i, task in enumerate(self._queue) if i in chosen]
        self._queue = deque(task for i, task in enumerate(self._queue) if i not in chosen)
        self.metrics.queue_size.set(len(self._queue))
        self.metrics.queue_jump.inc(selection.queue_jumps)
        self.metrics.granular_batch_addition.inc(selection.granular_additions)
        self.metrics.prefill_weight_limit_exceeded.inc(selection.prefill_weight_skips)
        self.metrics.prefill_padding_limit_exceeded.inc(selection.padding_skips)
        return group

    def _has_work(self) -> bool:
        """Whether a step has something to compute."""
        return bool(self._rows)

    def _running_tasks(self) -> list[GenerationTask]:
        return [row.task for row in self._rows]

    def _running_shapes(self) -> list[SequenceShape]:
        return [row.task.shape(row.tracker.generated_tokens) for row in self._rows]

    def _min_group_size(self, running: int) -> int:
        """SPEC §6.2 b: how many waiting requests justify interrupting decoding for a prefill."""
        return self.scheduler.min_group_size(running, self._steps_since_prefill) if running else 1

    def _may_add_now(self) -> bool:
        """SPEC §6.2 b: only add while the budget R ≥ 2 and the prefill cool-down has expired."""
        if not self._rows:
            return True
        remaining = sum(row.task.input.max_new_tokens - row.tracker.generated_tokens for row in self._rows)
        self.metrics.batch_max_remaining_tokens.set(remaining)
        return remaining >= 2 and time.monotonic() >= self._prefill_cooldown_until

    def _idle_wait(self) -> float:
        deadlines = [d for d in (task.deadline for task in self._queue) if d is not None]
        if not deadlines:
            return IDLE_WAIT_SECONDS
        return max(0.0, min(min(deadlines) - time.monotonic(), IDLE_WAIT_SECONDS))

    def _expire_queued(self, *, deadlines: bool) -> None:
        """Drop queued entries of gone clients; if `deadlines`, answer expired ones with TIME_LIMIT."""
        now = time.monotonic()
        kept: deque[GenerationTask] = deque()
        for task in self._queue:
            deadline = task.deadline
            if task.cancelled:
                self.metrics.request_failure.labels(err="cancelled").inc()
            elif deadlines and deadline is not None and now >= deadline:
                self.metrics.request_failure.labels(err="timeout").inc()
                task.sink(TokenEvent(generated_token_count=0, text="", stop_reason=StopReason.TIME_LIMIT))
            else:
                kept.append(task)
        if len(kept) != len(self._queue):
            self._queue = kept
            self.metrics.queue_size.set(len(kept))

    def _prefill(self, group: list[GenerationTask]) -> None:
        started = time.monotonic()
        for task in group:
            task.admitted_at = started
            self.metrics.request_queue_duration.observe(started - task.queued_at)
        rows = [task.prefill_row(self._wants_prompt_logits(task)) for task in group]
        self.metrics.batch_inference_count.labels(method="prefill").inc()
        self.metrics.batch_inference_batch_size.labels(method="prefill").observe(len(group))
        self.metrics.batch_next_tokens.observe(len(group) * max(t.shape().input_length for t in group))
        try:
            result = self.engine.prefill(rows)
        except AdapterUnavailableError as exc:  # only the rows using that adapter fail (SPEC §8)
            self._fail_adapter_rows(group, exc)
            return
        except Exception as exc:
            logger.exception("Prefill failed")
            self._set_health(GenerationHealth.FAILED)
            self.metrics.batch_inference_failure.labels(method="prefill", reason=failure_reason(exc)).inc()
            for task in group:
                self.metrics.request_failure.labels(err="generate").inc()
                task.sink(FailureEvent(Msg.GENERATION_FAILED.format(detail=failure_detail(exc))))
            return
        forward_done = time.monotonic()
        if self._rows:
            self.metrics.batch_concatenation_count.inc()
        new_rows = [RunningRow(task, self._tracker(task)) for task in group]
        # The new rows are sampled on their own, then merged, just as the engine merged their cache.
        group_sampler = self._new_sampler()
        group_sampler.add_rows(
            [task.input.sampling for task in group],
            [self._repetition_context(task) for task in group],
        )
        for row, prompt_logits in zip(new_rows, result.prompt_logits, strict=True):
            if row.task.input.params.response.input_tokens:
                row.task.sink(InputTokensEvent(self._input_token_infos(row.task, prompt_logits)))
        sample = group_sampler.sample(result.next_token_logits)
        self._sampler.extend(group_sampler)
        self._rows.extend(new_rows)
        self._apply(new_rows, sample)
        self._observe_step("prefill", len(group), started, forward_done)
        self._steps_since_prefill = 1
        self._prefill_cooldown_until = time.monotonic() + (time.monotonic() - started) / 2
        self._prune_finished()

    def _fail_adapter_rows(self, group: list[GenerationTask], exc: AdapterUnavailableError) -> None:
        logger.error(f"Adapter {exc.adapter_id} could not be loaded at batch time: {exc}")
        failing = [task for task in group if task.adapter_id == exc.adapter_id]
        for task in failing:
            self.metrics.request_failure.labels(err="generate").inc()
            detail = Msg.PREFIX_RETRIEVAL.format(id=exc.adapter_id)
            task.sink(FailureEvent(Msg.GENERATION_FAILED.format(detail=detail)))
        rest = [task for task in group if task.adapter_id != exc.adapter_id]
        if rest and len(rest) < len(group):
            self._prefill(rest)

    def _step(self) -> None:
        self._drop_cancelled_rows()
        if not self._rows:
            return
        started = time.monotonic()
        self.metrics.batch_inference_count.labels(method="next_token").inc()
        self.metrics.batch_inference_batch_size.labels(method="next_token").observe(len(self._rows))
        try:
            logits = self.engine.decode([row.last_token for row in self._rows])
        except Exception as exc:
            logger.exception("Next-token step failed")
            self._set_health(GenerationHealth.FAILED)
            self.metrics.batch_inference_failure.labels(method="next_token", reason=failure_reason(exc)).inc()
            self._fail_rows(self._rows, failure_detail(exc), per_request=failure_reason(exc) != "oom")
            return
        forward_done = time.monotonic()
        self._apply(self._rows, self._sampler.sample(logits))
        self._observe_step("next_token", len(self._rows), started, forward_done)
        self._steps_since_prefill += 1
        self._prune_finished()

    def _apply(self, rows: Sequence[RunningRow], sample: StepSample) -> None:
        """Feed each row its new token: detokenize, apply stop rules, emit the event."""
        for position, (row, token_id, detail) in enumerate(
            zip(rows, sample.token_ids, sample.details, strict=True)
        ):
            row.last_token = token_id
            try:
                outcome = row.tracker.on_token(token_id)
                if position in sample.guide_finished and not outcome.finished:
                    outcome = _guide_finished(row.tracker, outcome)
            except Exception as exc:  # this request alone fails (SPEC §3.2); the batch goes on
                self._fail_detokenization(row, exc)
                continue
            token = self._token_info(row.task, token_id, detail)
            if not outcome.finished and not outcome.text and token is None:
                continue  # SPEC §4.3: empty progress messages are suppressed
            if outcome.finished:
                self._observe_finish(row)  # first: the final event's reader sees the finish time
            row.task.sink(
                TokenEvent(
                    outcome.generated_tokens, outcome.text, token, outcome.stop_reason, outcome.stop_sequence
                )
            )

    def _drop_cancelled_rows(self) -> None:
        cancelled = [row for row in self._rows if row.task.cancelled]
        for _ in cancelled:
            self.metrics.request_failure.labels(err="cancelled").inc()
        if cancelled:
            self._keep([i for i, row in enumerate(self._rows) if not row.task.cancelled])

    def _prune_finished(self) -> None:
        keep = [i for i, row in enumerate(self._rows) if not (row.tracker.finished or row.failed)]
        if len(keep) != len(self._rows):
            self._keep(keep)

    def _keep(self, indices: list[int]) -> None:
        self.engine.keep_rows(indices)
        self._sampler.keep_rows(indices)
        self._rows = [self._rows[i] for i in indices]
        self.metrics.batch_current_size.set(len(self._rows))
        self._observe_kv_usage()

    def _observe_kv_usage(self) -> None:
        self._kv_cache_usage = self._kv_usage_now()
        self.metrics.kv_cache_usage.set(self._kv_cache_usage)
        if not self._has_work():  # every path that empties the batch passes here; no stale tokens
            self.metrics.batch_input_tokens.set(0)

    def _kv_usage_now(self) -> float:
        """The running batch's share of the memory model's capacity (of MAX_BATCH_SIZE without one)."""
        weights = self.scheduler.weights
        if math.isinf(weights.max_weight) or weights.max_weight <= 0:
            return len(self._rows) / self.scheduler.max_batch_size
        return min(1.0, weights.initial(self._running_shapes()) / weights.max_weight)

    def _fail_rows(self, rows: Sequence[RunningRow], detail: str, *, per_request: bool = True) -> None:
        """Fail every running row; `per_request` details say how far each got (SPEC §3.2)."""
        for row in rows:
            self.metrics.request_failure.labels(err="generate").inc()
            generated = row.tracker.generated_tokens
            own = Msg.ERROR_AFTER_TOKENS.format(count=generated, error=detail) if generated else detail
            row.task.sink(FailureEvent(Msg.GENERATION_FAILED.format(detail=own if per_request else detail)))
        self._rows = []
        self.engine.clear()
        self._sampler = self._new_sampler()
        self.metrics.batch_current_size.set(0)
        self._observe_kv_usage()

    def _fail_detokenization(self, row: RunningRow, exc: Exception) -> None:
        logger.exception("Detokenization failed")
        self.metrics.request_failure.labels(err="generate").inc()
        detail = Msg.TOKEN_DECODING.format(error=exc)
        row.task.sink(FailureEvent(Msg.DETOKENIZATION_FAILED.format(detail=detail)))
        row.failed = True

    # ---- health ---------------------------------------------------------------------------------------

    def _set_health(self, health: GenerationHealth) -> None:
        if health != self.generation_health:
            self.generation_health = health
            if self._on_health is not None:
                self._on_health(health)

    def _run_probes(self) -> None:
        with self._cond:
            probes, self._probes = self._probes, []
        for probe in probes:
            if not probe.result.set_running_or_notify_cancel():
                continue
            try:
                token = self._probe_generation(probe.input_ids)
            except Exception as exc:
                logger.exception("Health-check generation failed")
                self._set_health(GenerationHealth.FAILED)
                probe.result.set_exception(exc)
            else:
                self._set_health(GenerationHealth.HEALTHY)
                probe.result.set_result(token)

    def _probe_generation(self, input_ids: Sequence[int]) -> int:
        """Prefill the probe as an extra row, take its greedy token, then drop the row again."""
        running = len(self._rows)
        try:
            result = self.engine.prefill([PrefillRow(input_ids)])
            return int(result.next_token_logits[-1].argmax())
        finally:
            self.engine.keep_rows(list(range(running)))

    def _abandon_probes(self) -> None:
        with self._cond:
            probes, self._probes = self._probes, []
        for probe in probes:
            if probe.result.set_running_or_notify_cancel():
                probe.result.set_exception(RuntimeError("the engine loop stopped"))

    # ---- per-request helpers ------------------------------------------------------------------------

    def _new_sampler(self) -> BatchSampler:
        spec = self.engine.spec
        return BatchSampler(spec.vocab_size, self._eos_token_ids(), spec.device)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a request with EOS_TOKEN (guided-decoding grammars end on them too)."""
        return self._eos_token_ids()

    def _eos_token_ids(self) -> tuple[int, ...]:
        """The model config's EOS ids, else the tokenizer's EOS (SPEC §5.5)."""
        if self.engine.spec.eos_token_ids:
            return self.engine.spec.eos_token_ids
        eos = self.tokenizer.hf.eos_token_id
        return () if eos is None else (int(eos),)

    def _tracker(self, task: GenerationTask) -> OutputTracker:
        spec = self.engine.spec
        criteria = StopCriteria.from_params(
            task.input.params.stopping,
            eos_token_ids=frozenset(self._eos_token_ids()),
            arrival_time=task.arrival,
            max_new_tokens=task.input.max_new_tokens,
        )
        detokenizer = for_tokenizer(
            self.tokenizer.hf,
            task.input.input_ids,
            decoder_only=not spec.is_encoder_decoder,
            skip_special_tokens=self.tokenizer.skip_special_tokens,
        )
        return OutputTracker(criteria, detokenizer)

    def _repetition_context(self, task: GenerationTask) -> Sequence[int]:
        return () if self.engine.spec.is_encoder_decoder else task.input.input_ids

    def _wants_prompt_logits(self, task: GenerationTask) -> bool:
        return task.input.params.response.input_tokens and not self.engine.spec.is_encoder_decoder

    def _token_info(
        self, task: GenerationTask, token_id: int, detail: TokenDetail | None
    ) -> TokenInfo | None:
        if not task.input.params.response.generated_tokens:
            return None
        return self._to_token_info(token_id, detail)

    def _to_token_info(self, token_id: int, detail: TokenDetail | None) -> TokenInfo:
        if detail is None:
            return TokenInfo(text=self.tokenizer.token_strings([token_id])[0])
        ids = [token_id, *(top.token_id for top in detail.top_tokens)]
        texts = self.tokenizer.token_strings(ids)
        top = tuple((text, t.logprob) for text, t in zip(texts[1:], detail.top_tokens, strict=True))
        return TokenInfo(text=texts[0], logprob=detail.logprob, rank=detail.rank, top_tokens=top)

    def _input_token_infos(self, task: GenerationTask, prompt_logits) -> tuple[TokenInfo, ...]:
        response = task.input.params.response
        ids = self._virtual_prefix_ids(task) + task.input.input_ids
        if prompt_logits is None:  # encoder-decoder: text only, NaN logprob when asked (SPEC §2.5)
            logprob = math.nan if response.token_logprobs else 0.0
            return tuple(TokenInfo(text=text, logprob=logprob) for text in self.tokenizer.token_strings(ids))
        details = prompt_token_details(
            prompt_logits,
            ids,
            want_logprobs=response.token_logprobs,
            want_ranks=response.token_ranks,
            top_n=response.top_n_tokens,
        )
        return tuple(self._to_token_info(token_id, d) for token_id, d in zip(ids, details, strict=True))

    def _virtual_prefix_ids(self, task: GenerationTask) -> tuple[int, ...]:
        """Prefix positions in input token details, reported as the pad token (SPEC §15 #7, as TGIS does)."""
        prefix = task.input.adapter
        if not isinstance(prefix, PrefixEmbeddings):
            return ()
        virtual = prefix.encoder if self.engine.spec.is_encoder_decoder else prefix.decoder
        return (self.engine.spec.pad_token_id,) * (0 if virtual is None else int(virtual.shape[0]))

    def _observe_step(self, method: str, size: int, started: float, forward_done: float) -> None:
        done = time.monotonic()
        makeup = "single_only"
        self._set_health(GenerationHealth.HEALTHY)
        self.metrics.batch_inference_success.labels(method=method).inc()
        self.metrics.batch_inference_forward_duration.labels(method=method, makeup=makeup).observe(
            forward_done - started
        )
        self.metrics.batch_inference_tokproc_duration.labels(method=method, makeup=makeup).observe(
            done - forward_done
        )
        self.metrics.batch_inference_duration.labels(method=method, makeup=makeup).observe(done - started)
        self.metrics.batch_current_size.set(len(self._rows))
        self._observe_kv_usage()
        # Padded batch: every row is as long as the longest one.
        lengths = [r.task.shape(r.tracker.generated_tokens).input_length for r in self._rows]
        self.metrics.batch_input_tokens.set(max(lengths, default=0) * len(lengths))

    def _observe_finish(self, row: RunningRow) -> None:
        generated = row.tracker.generated_tokens
        row.task.finished_at = time.monotonic()
        assert row.task.admitted_at is not None  # set when the row was prefilled
        elapsed = row.task.finished_at - row.task.admitted_at
        self.metrics.request_inference_duration.observe(elapsed)
        self.metrics.request_generated_tokens.observe(generated)
        self.metrics.request_total_tokens.observe(generated + len(row.task.input.input_ids))
        if generated:
            self.metrics.request_mean_time_per_token_duration.observe(elapsed / generated)


def _guide_finished(tracker: OutputTracker, outcome: TokenOutcome) -> TokenOutcome:
    """Guided-decoding hook: the row's grammar is complete, so it ends now with EOS_TOKEN.

    Only reached when the tracker did not stop on the grammar's final (EOS) token itself, i.e.
    while min_new_tokens was still unmet; the text this token released is kept.
    """
    final = tracker.finish_now(StopReason.EOS_TOKEN)
    return replace(final, text=outcome.text + final.text)


def _distinct_adapter_ids(tasks: Sequence[GenerationTask]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for task in tasks if (name := task.adapter_name) is not None))


def failure_reason(exc: BaseException) -> str:
    return "oom" if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower() else "error"


def failure_detail(exc: BaseException) -> str:
    return Msg.GPU_OUT_OF_MEMORY if failure_reason(exc) == "oom" else str(exc)
