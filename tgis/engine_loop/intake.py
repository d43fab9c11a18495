"""The queue between the front doors and the engine-loop thread: submit, health probes, expiry, load.

Everything here is shared between threads and guarded by one condition: the asyncio side submits
tasks and probes; the loop thread waits for work, takes the requests admission picks, and expires
queued ones whose client left or whose deadline passed (SPEC §5.6).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.tasks import GenerationTask
from tgis.errors import GenerationError, Msg, OverloadedError
from tgis.types import StopReason, TokenEvent

MAX_QUEUE_SIZE = 10_000
IDLE_WAIT_SECONDS = 1.0


@dataclass(eq=False)
class Probe:
    """A health-check generation waiting for the loop thread; the future gets the greedy token."""

    input_ids: Sequence[int]
    result: Future[int] = field(default_factory=Future)


class Intake:
    """Queued tasks and pending probes; `alive` tells whether a loop thread will ever take them."""

    def __init__(self, metrics: LoopMetrics, alive: Callable[[], bool]) -> None:
        self._metrics = metrics
        self._alive = alive
        self._cond = threading.Condition()
        self._queue: deque[GenerationTask] = deque()
        self._probes: list[Probe] = []
        self._stopping = False

    # ---- any thread ---------------------------------------------------------------------------------

    def submit(self, tasks: Sequence[GenerationTask]) -> None:
        with self._cond:
            if self._stopping or not self._alive():  # nothing would ever answer these
                raise GenerationError(Msg.GENERATION_FAILED.format(detail="the batching loop is not running"))
            if len(self._queue) + len(tasks) > MAX_QUEUE_SIZE:
                self._metrics.failed("queue_full")
                raise OverloadedError(Msg.QUEUE_FULL)
            self._queue.extend(tasks)
            self._metrics.queued(len(self._queue))
            self._cond.notify_all()

    def probe(self, input_ids: Sequence[int]) -> Future[int]:
        """A 1-token greedy generation that bypasses the queue but runs between forward passes."""
        probe = Probe(input_ids)
        with self._cond:
            if self._stopping or not self._alive():
                probe.result.set_exception(RuntimeError("the engine loop is not running"))
            else:
                self._probes.append(probe)
                self._cond.notify_all()
        return probe.result

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def waiting(self) -> list[GenerationTask]:
        with self._cond:
            return list(self._queue)

    # ---- the loop thread ----------------------------------------------------------------------------

    def wait_for_work(self, busy: bool) -> bool:
        """Block until there is something to do (`busy`: the runner has work already); False once
        stopping. Queued requests of clients that left are dropped meanwhile."""
        with self._cond:
            while True:
                self._expire(deadlines=False)
                if self._stopping:
                    return False
                if busy or self._queue or self._probes:
                    return True
                self._cond.wait(self._idle_wait())

    def take(self, choose: Callable[[list[GenerationTask]], Sequence[int]]) -> list[GenerationTask]:
        """Dequeue the tasks `choose` picks (positions in the queue, in queue order). Deadlines count
        only for the ones left behind: an admitted request always yields at least one token, even
        with a 1 ms limit (SPEC §5.6)."""
        with self._cond:
            chosen = set(choose(list(self._queue))) if self._queue else set()
            taken = [task for i, task in enumerate(self._queue) if i in chosen]
            if taken:
                self._queue = deque(task for i, task in enumerate(self._queue) if i not in chosen)
            self._expire(deadlines=True)
            self._metrics.queued(len(self._queue))
            return taken

    def take_probes(self) -> list[Probe]:
        with self._cond:
            probes, self._probes = self._probes, []
        return probes

    def close(self) -> tuple[list[GenerationTask], list[Probe]]:
        """After a crash or at the end: refuse new work from now on; return what was still waiting."""
        with self._cond:
            self._stopping = True
            tasks, self._queue = list(self._queue), deque()
            probes, self._probes = self._probes, []
        return tasks, probes

    def _idle_wait(self) -> float:
        deadlines = [d for d in (task.deadline for task in self._queue) if d is not None]
        if not deadlines:
            return IDLE_WAIT_SECONDS
        return max(0.0, min(min(deadlines) - time.monotonic(), IDLE_WAIT_SECONDS))

    def _expire(self, *, deadlines: bool) -> None:
        """Drop queued entries of gone clients; if `deadlines`, answer expired ones with TIME_LIMIT."""
        now = time.monotonic()
        kept: deque[GenerationTask] = deque()
        for task in self._queue:
            deadline = task.deadline
            if task.cancelled:
                self._metrics.failed("cancelled")
            elif deadlines and deadline is not None and now >= deadline:
                self._metrics.failed("timeout")
                task.sink(TokenEvent(generated_token_count=0, text="", stop_reason=StopReason.TIME_LIMIT))
            else:
                kept.append(task)
        if len(kept) != len(self._queue):
            self._queue = kept
            self._metrics.queued(len(kept))
