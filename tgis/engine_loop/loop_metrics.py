"""Every Prometheus metric the engine loop writes, in one place (SPEC §11's batch and request metrics)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from tgis.batching.admission import Selection
from tgis.engine_loop.results import BatchUsage, StepStats
from tgis.engine_loop.tasks import GenerationTask
from tgis.metrics import Metrics

MAKEUP = "single_only"
GAUGE_ACCEPTANCE_WEIGHT = 0.05  # weight of the newest step in the acceptance-rate gauge (about 20 steps)


@dataclass(frozen=True)
class _StepSeries:
    """The labelled series one kind of step writes, looked up once: each `labels()` call costs
    prometheus-client a validation and a lock. A one-stream int4 decode step's metrics took 0.041
    instead of 0.067 ms (medians of 16 runs beside each other, 2-core Zen 4)."""

    count: Counter
    batch_size: Histogram
    success: Counter
    forward: Histogram
    tokproc: Histogram
    duration: Histogram

    @classmethod
    def of(cls, m: Metrics, method: str) -> _StepSeries:
        return cls(
            count=m.batch_inference_count.labels(method=method),
            batch_size=m.batch_inference_batch_size.labels(method=method),
            success=m.batch_inference_success.labels(method=method),
            forward=m.batch_inference_forward_duration.labels(method=method, makeup=MAKEUP),
            tokproc=m.batch_inference_tokproc_duration.labels(method=method, makeup=MAKEUP),
            duration=m.batch_inference_duration.labels(method=method, makeup=MAKEUP),
        )


class LoopMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._acceptance: float | None = None
        self._steps: dict[str, _StepSeries] = {}
        self._blocks: dict[str, Gauge] = {}  # tgi_kv_cache_blocks by state, once a paged runner sets them

    # ---- how the engine runs (set once at start) -----------------------------------------------------

    def attention(self, path: str, fallback: str | None) -> None:
        self.metrics.attention_path.clear()
        self.metrics.attention_path.labels(path=path, fallback=fallback or "").set(1)

    def graphs_captured(self, count: int) -> None:
        self.metrics.cuda_graphs_captured.set(count)

    # ---- queue and admission ------------------------------------------------------------------------

    def queued(self, size: int) -> None:
        self.metrics.queue_size.set(size)

    def selected(self, selection: Selection) -> None:
        m = self.metrics
        m.queue_jump.inc(selection.queue_jumps)
        m.granular_batch_addition.inc(selection.granular_additions)
        m.prefill_weight_limit_exceeded.inc(selection.prefill_weight_skips)
        m.prefill_padding_limit_exceeded.inc(selection.padding_skips)

    def admitted(self, task: GenerationTask, now: float) -> None:
        self.metrics.request_queue_duration.observe(now - task.queued_at)
        self.metrics.vllm.request_queue_time.observe(now - task.queued_at)

    def remaining_tokens(self, remaining: int) -> None:
        """R of SPEC §6.2 b, as the padded batch sees it when it considers adding requests."""
        self.metrics.batch_max_remaining_tokens.set(remaining)

    def prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.metrics.prefix_cache_queries.inc(queried_tokens)
        self.metrics.prefix_cache_hits.inc(hit_tokens)

    # ---- steps --------------------------------------------------------------------------------------

    def step(self, stats: StepStats, *, failed: str | None) -> None:
        """One forward pass; `failed` is its failure reason ("oom" or "error") if it raised."""
        m, method = self.metrics, stats.method
        series = self._steps.get(method)
        if series is None:
            series = self._steps[method] = _StepSeries.of(m, method)
        series.count.inc()
        series.batch_size.observe(stats.batch_size)
        if stats.prompt_tokens:
            m.batch_next_tokens.observe(stats.prompt_tokens)
        if failed is not None:
            m.batch_inference_failure.labels(method=method, reason=failed).inc()
            return
        if stats.joined:
            m.batch_concatenation_count.inc()
        if stats.draft_tokens:
            self._speculation(stats)
        done = time.monotonic()
        series.success.inc()
        series.forward.observe(stats.forward_done - stats.started)
        series.tokproc.observe(done - stats.forward_done)
        series.duration.observe(done - stats.started)

    def _speculation(self, stats: StepStats) -> None:
        m = self.metrics
        m.speculation_proposed.inc(stats.draft_tokens)
        m.speculation_accepted.inc(stats.accepted_tokens)
        for run in stats.speculative_runs:
            m.speculation_tokens_per_step.observe(run)
        rate = stats.accepted_tokens / stats.draft_tokens
        previous = self._acceptance
        weight = GAUGE_ACCEPTANCE_WEIGHT
        self._acceptance = rate if previous is None else previous + weight * (rate - previous)
        m.speculation_acceptance.set(self._acceptance)

    def usage(self, usage: BatchUsage, input_tokens: int | None = None) -> None:
        """The batch's gauges after a change; the input-token gauge drops to 0 whenever it empties."""
        m = self.metrics
        m.batch_current_size.set(usage.admitted)
        m.kv_cache_usage.set(usage.kv_cache_usage)
        if usage.blocks_total is not None:
            if not self._blocks:
                states = ("total", "used", "cached")
                self._blocks = {state: m.kv_cache_blocks.labels(state=state) for state in states}
            self._blocks["total"].set(usage.blocks_total)
            self._blocks["used"].set(usage.blocks_used or 0)
            self._blocks["cached"].set(usage.blocks_cached or 0)
        if not usage.admitted:
            m.batch_input_tokens.set(0)
        elif input_tokens is not None:
            m.batch_input_tokens.set(input_tokens)

    # ---- requests -----------------------------------------------------------------------------------

    def failed(self, err: str) -> None:
        """tgi_request_failure: err is validation, queue_full, generate, cancelled, timeout, ..."""
        self.metrics.request_failure.labels(err=err).inc()

    def tokens(self, task: GenerationTask, count: int) -> None:
        """A step gave a request `count` tokens: its first (time to first token, from the call's arrival;
        its prompt counted) or a later one (inter-token latency: since its previous step's tokens)."""
        m = self.metrics
        now = time.monotonic()
        if task.last_token_at is None:
            m.request_first_token_duration.observe(now - task.arrival)
            m.vllm.time_to_first_token.observe(now - task.arrival)
            m.prompt_tokens.inc(len(task.input.input_ids))
            m.vllm.prompt_tokens.inc(len(task.input.input_ids))
        else:
            m.request_inter_token_duration.observe(now - task.last_token_at)
            m.vllm.inter_token_latency.observe(now - task.last_token_at)
        task.last_token_at = now
        m.generation_tokens.inc(count)
        m.vllm.generation_tokens.inc(count)

    def finished(self, task: GenerationTask, generated: int) -> None:
        """A request's last token: its inference time and token counts (sets `task.finished_at`)."""
        m = self.metrics
        task.finished_at = time.monotonic()
        assert task.admitted_at is not None  # set when the task was admitted
        elapsed = task.finished_at - task.admitted_at
        m.request_inference_duration.observe(elapsed)
        m.vllm.e2e_request_latency.observe(task.finished_at - task.arrival)
        m.request_generated_tokens.observe(generated)
        m.request_total_tokens.observe(generated + len(task.input.input_ids))
        if generated:
            m.request_mean_time_per_token_duration.observe(elapsed / generated)
