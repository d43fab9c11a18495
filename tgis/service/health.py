"""Serving state: the HTTP health verdict (generation probe / device check) and the drain gate (§9.4, §11)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from tgis.engine_loop.core import EngineLoop
from tgis.errors import Msg, ShuttingDownError

logger = logging.getLogger(__name__)

LIVENESS_TEXT = "liveness"
HEALTH_CHECK_TIMEOUT_SECONDS = 60.0


class Verdict(enum.Enum):
    """What `GET /health` answers; the values are TGIS's 503 error bodies."""

    HEALTHY = ""
    UNHEALTHY = "unhealthy"
    TIMED_OUT = "Healthcheck timed-out"


class HealthChecker:
    """While generation is not known healthy, run a real 1-token greedy generation of `liveness`
    (the loop serialises it with forward passes); once it is, only touch the device."""

    def __init__(
        self,
        loop: EngineLoop,
        probe_ids: Sequence[int],
        device: torch.device,
        *,
        failed: Callable[[], bool],
        timeout: float = HEALTH_CHECK_TIMEOUT_SECONDS,
    ) -> None:
        self.loop = loop
        self.probe_ids = list(probe_ids)
        self.device = device
        self.timeout = timeout
        self._failed = failed
        self._probe: asyncio.Future[int] | None = None

    async def check(self) -> Verdict:
        if self._failed() or not self.loop.alive:
            return Verdict.UNHEALTHY
        try:
            async with asyncio.timeout(self.timeout):
                if self.loop.generation_healthy:
                    await asyncio.to_thread(device_check, self.device)
                else:
                    await asyncio.shield(self._shared_probe())
        except TimeoutError:
            logger.error(f"Health check did not finish within {self.timeout:g} s")
            return Verdict.TIMED_OUT
        except Exception as exc:
            logger.error(f"Health check failed: {exc}")
            return Verdict.UNHEALTHY
        return Verdict.HEALTHY

    def _shared_probe(self) -> asyncio.Future[int]:
        # Concurrent checks wait on the same generation instead of queueing one each.
        if self._probe is None or self._probe.done():
            self._probe = asyncio.wrap_future(self.loop.probe(self.probe_ids))
        return self._probe


def device_check(device: torch.device) -> None:
    """A tiny allocation on the model's device; on CUDA, wait for it so a wedged GPU shows."""
    torch.zeros(1, device=device).add_(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DrainGate:
    """Counts generation calls in flight; once closed (SIGTERM) it refuses new ones.
    Lives on the asyncio loop, so it needs no lock."""

    def __init__(self) -> None:
        self.closed = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        if self.closed:
            raise ShuttingDownError(Msg.SHUTTING_DOWN)
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def close(self, grace: float) -> int:
        """Refuse new calls, wait up to `grace` seconds for those in flight; returns how many remain."""
        self.closed = True
        if self.in_flight:
            logger.info(f"Draining: waiting up to {grace:g} s for {self.in_flight} call(s) in flight")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        return self.in_flight
