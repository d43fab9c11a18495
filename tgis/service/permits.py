"""The MAX_CONCURRENT_REQUESTS pool: one permit per input, taken without waiting (SPEC §3.2)."""

from __future__ import annotations

import threading


class Permits:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._in_use

    def try_hold(self, count: int) -> Permits.Held | None:
        """Take `count` permits at once, or none if they are not all free right now."""
        with self._lock:
            if self._in_use + count > self.capacity:
                return None
            self._in_use += count
        return Permits.Held(self, count)

    def _release(self, count: int) -> None:
        with self._lock:
            self._in_use -= count

    class Held:
        """Permits held for the life of a call; released once, by `release()` or the end of an
        `async with` block."""

        def __init__(self, pool: Permits, count: int) -> None:
            self._pool = pool
            self._count = count

        def release(self) -> None:
            count, self._count = self._count, 0
            if count:
                self._pool._release(count)

        async def __aenter__(self) -> None:
            return None

        async def __aexit__(self, *exc_info: object) -> None:
            self.release()
