"""The engine loop: one thread stepping admit → schedule → execute → update → emit over a batch runner.

The loop is composed, not specialised: `Intake` holds the queue and probes, a `BatchRunner` (paged or
padded) owns the engine and the sampler rows, the `OutputProcessor` turns step results into client
events, and `LoopMetrics` records them. A failure that belongs to one request fails that request
alone; anything that escapes a step (the engine in an unknown state: a dead tensor-parallel rank)
crashes the loop, which fails every request still waiting and stops the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from engines.base import AdapterUnavailableError
from tgis.engine_loop.intake import Intake
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.outputs import OutputProcessor
from tgis.engine_loop.results import BatchUsage, StepResult
from tgis.engine_loop.runner import BatchRunner
from tgis.engine_loop.tasks import GenerationTask, ValidatedInput
from tgis.errors import Msg
from tgis.types import GenerationHealth

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopLoad:
    """What the loop carries right now, for load gauges that gateways and autoscalers read."""

    waiting: int  # requests queued, not yet admitted
    running: int  # requests admitted (prefilling or decoding)
    kv_cache_usage: float  # 0-1: the share of the KV-cache capacity the running batch holds
    running_adapters: tuple[str, ...]  # adapter ids (LoRA or prefix) of running requests, distinct
    waiting_adapters: tuple[str, ...]  # adapter ids of queued requests, distinct


class EngineLoop:
    """Owns the runner from one thread; the asyncio side only submits tasks and reads events."""

    def __init__(
        self,
        runner: BatchRunner,
        outputs: OutputProcessor,
        metrics: LoopMetrics,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        on_health: Callable[[GenerationHealth], None] | None = None,
        evicted_loras: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.runner = runner
        self.outputs = outputs
        self.metrics = metrics
        self._on_fatal = on_fatal
        self._on_health = on_health
        self._evicted_loras = evicted_loras  # the adapter store's evictions, unloaded from the engine here
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.intake = Intake(metrics, alive=self._thread.is_alive)
        # Written only by the loop thread; every forward pass (requests and health probes) updates it.
        self.generation_health = GenerationHealth.UNKNOWN
        self._usage = BatchUsage(admitted=0, kv_cache_usage=0.0)

    # ---- asyncio side -------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.intake.stop()
        self._thread.join(timeout)

    def submit(self, tasks: Sequence[GenerationTask]) -> None:
        self.intake.submit(tasks)

    def probe(self, input_ids: Sequence[int]) -> Future[int]:
        return self.intake.probe(input_ids)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def generation_healthy(self) -> bool:
        return self.generation_health == GenerationHealth.HEALTHY

    @property
    def admitted_count(self) -> int:
        """Requests admitted and not yet finished (prefilling or decoding)."""
        return self._usage.admitted

    def too_large(self, validated: ValidatedInput) -> str | None:
        """Why this input could never run here (a beam search wider than the KV cache); any thread."""
        return self.runner.too_large(validated)

    def load(self) -> LoopLoad:
        """A snapshot of the queue and the running batch; safe to call from any thread."""
        waiting = self.intake.waiting()
        running = self.outputs.tasks()
        return LoopLoad(
            waiting=len(waiting),
            running=len(running),
            kv_cache_usage=self._usage.kv_cache_usage,
            running_adapters=_distinct_adapter_ids(running),
            waiting_adapters=_distinct_adapter_ids(waiting),
        )

    # ---- the loop thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self.intake.wait_for_work(self.runner.busy):
                self._run_probes()
                self._unload_evicted_loras()
                self._step()
        except BaseException as exc:  # the loop must never die silently
            logger.exception("The batching loop crashed")
            if self._on_fatal is not None:
                self._on_fatal(exc)
            self._abandon("batching loop crashed")
        finally:
            self._abandon_probes()

    def _step(self) -> None:
        self._admit()
        self._release(self.outputs.cancelled())
        plan = self.runner.schedule()
        result = self.runner.execute(plan) if plan is not None else StepResult()
        self._release(self.outputs.update(result).finished)
        self._observe(result)
        self.outputs.emit()

    def _admit(self) -> None:
        taken = self.intake.take(self._select)
        now = time.monotonic()
        for task in taken:
            task.admitted_at = now
            self.metrics.admitted(task, now)
            try:
                self.outputs.start(task)
                self.runner.add(task)
            except Exception as exc:  # this request alone cannot be served
                self._reject(task, exc)

    def _select(self, waiting: list[GenerationTask]) -> Sequence[int]:
        selection = self.runner.select(waiting)
        self.metrics.selected(selection)
        return selection.indices

    def _reject(self, task: GenerationTask, exc: Exception) -> None:
        if isinstance(exc, AdapterUnavailableError):
            logger.error(f"Adapter {exc.adapter_id} could not be loaded at batch time: {exc}")
            detail = Msg.PREFIX_RETRIEVAL.format(id=exc.adapter_id)
        else:
            logger.exception(f"Request {task.id} could not be admitted")
            detail = str(exc)
        self.runner.release([task.id])
        self.outputs.reject(task, detail)

    def _release(self, task_ids: Iterable[int]) -> None:
        ids = list(task_ids)
        if ids:
            self.runner.release(ids)

    def _observe(self, result: StepResult) -> None:
        """The step's metrics and the batch's gauges; any forward pass decides generation health."""
        stats = result.stats
        if stats is not None:
            self.metrics.step(stats, failed=result.engine_error)
            self._set_health(GenerationHealth.FAILED if result.engine_error else GenerationHealth.HEALTHY)
        self._usage = self.runner.usage()
        self.metrics.usage(self._usage, None if stats is None else stats.input_tokens)

    def _unload_evicted_loras(self) -> None:
        if self._evicted_loras is not None:
            self.runner.unload_loras(self._evicted_loras())

    def _abandon(self, detail: str) -> None:
        """After a crash: fail every request still waiting (admitted or queued) so that no client
        hangs; the engine is not touched, it may be what failed."""
        tasks, probes = self.intake.close()
        self.outputs.abandon(tasks, detail)
        self.outputs.emit()
        _fail_probes(probes)

    # ---- health -------------------------------------------------------------------------------------

    def _set_health(self, health: GenerationHealth) -> None:
        if health != self.generation_health:
            self.generation_health = health
            if self._on_health is not None:
                self._on_health(health)

    def _run_probes(self) -> None:
        for probe in self.intake.take_probes():
            if not probe.result.set_running_or_notify_cancel():
                continue
            try:
                token = self.runner.probe(probe.input_ids)
            except Exception as exc:
                logger.exception("Health-check generation failed")
                self._set_health(GenerationHealth.FAILED)
                probe.result.set_exception(exc)
            else:
                self._set_health(GenerationHealth.HEALTHY)
                probe.result.set_result(token)

    def _abandon_probes(self) -> None:
        _fail_probes(self.intake.close()[1])


def _fail_probes(probes: Iterable) -> None:
    for probe in probes:
        if probe.result.set_running_or_notify_cancel():
            probe.result.set_exception(RuntimeError("the engine loop stopped"))


def _distinct_adapter_ids(tasks: Sequence[GenerationTask]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for task in tasks if (name := task.adapter_name) is not None))
