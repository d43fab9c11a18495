"""A call's inputs in the engine loop with the permits they hold, from ServiceContext.start to close."""

from __future__ import annotations

from tgis.service.events import Submitted
from tgis.service.permits import Permits


class Started:
    """What `ServiceContext.start` hands a front door: its submitted inputs, in prompt order. Closing it
    (the end of an `async with`, or `close()`) cancels the inputs not finished yet, which frees their
    slots and KV blocks in the loop, and releases the call's permits; a second close does nothing."""

    def __init__(self, submitted: list[Submitted], held: Permits.Held) -> None:
        self.submitted = submitted
        self._held = held

    def close(self) -> None:
        for submitted in self.submitted:
            submitted.task.cancelled = True  # a no-op once finished; frees the slot if the client left
        self._held.release()

    async def __aenter__(self) -> Started:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
