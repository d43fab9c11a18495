"""Carries the engine thread's events to the requests' asyncio queues.

A step yields one event per running request. Waking the event loop for each one costs a write to its
self-pipe and a fight for the GIL per event while the engine thread is still in the step's Python
(32 rows: 32 wake-ups per step). Events are queued here instead and the loop is woken only when none is
pending yet: one wake-up carries every event the step produced meanwhile, each request's in order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from tgis.types import GenerationEvent

Sink = Callable[[GenerationEvent], None]


class EventDelivery:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[GenerationEvent], GenerationEvent]] = []

    def sink(self, events: asyncio.Queue[GenerationEvent]) -> Sink:
        """A callable for the engine thread that puts an event on `events`."""

        def put(event: GenerationEvent) -> None:
            with self._lock:
                self._pending.append((events, event))
                wake = len(self._pending) == 1  # otherwise a wake-up is already on its way
            if wake:
                self.loop.call_soon_threadsafe(self._drain)

        return put

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for events, event in pending:
            events.put_nowait(event)
