"""The soak's load phases: a warm-up of every kind, a closed-loop saturation probe, the open loop itself."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from tgis_bench.soak.client import SoakRecord
from tgis_bench.soak.mix import Arrival

Send = Callable[[Arrival], Awaitable[SoakRecord]]
WARMUP_NEW_TOKENS = 4


class SoakError(RuntimeError):
    """The server cannot be soaked as configured (a kind fails before the load starts)."""


async def warm_up(send: Send, kinds: Sequence[str], expected: Mapping[str, frozenset[str]]) -> None:
    """One short request of each kind, one at a time: adapters load and guides compile before the
    clock starts, and a kind this server cannot answer stops the soak before it begins."""
    failures = []
    for index, kind in enumerate(kinds):
        record = await send(Arrival(index, 0.0, kind, index, WARMUP_NEW_TOKENS))
        if record.code not in expected[kind]:
            failures.append(f"{kind}: {record.code}")
    if failures:
        raise SoakError(f"the warm-up request of these kinds failed: {', '.join(failures)}")


@dataclass(frozen=True)
class Saturation:
    """What a closed loop of `concurrency` clients got through the server, with the mix: the answers that
    came in the last two thirds of `seconds` (the first third fills the batch), per second."""

    concurrency: int
    seconds: float
    requests: int  # answered in the counted part of the probe
    requests_per_second: float
    tokens_per_second: float
    codes: dict[str, int]


def saturation(records: Sequence[SoakRecord], concurrency: int, seconds: float) -> Saturation:
    """Only answers that came after the first third and within `seconds` count: the rate the server
    sustains once full, not its ramp up nor the requests still running when the probe stopped sending."""
    counted_from = seconds / 3
    done = [r for r in records if counted_from <= r.end <= seconds]
    span = seconds - counted_from
    return Saturation(
        concurrency=concurrency,
        seconds=seconds,
        requests=len(done),
        requests_per_second=len(done) / span,
        tokens_per_second=sum(r.tokens for r in done) / span,
        codes=dict(sorted(Counter(r.code for r in done).items())),
    )


async def probe_saturation(
    send: Send, draws: Iterator[Arrival], *, concurrency: int, seconds: float, zero: float
) -> Saturation:
    """`concurrency` clients each send the next drawn request when their last one ends, for `seconds`
    (the requests still running then are waited for)."""
    records: list[SoakRecord] = []

    async def client() -> None:
        while time.perf_counter() - zero < seconds:
            records.append(await send(next(draws)))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return saturation(records, concurrency, seconds)


class OpenLoop:
    """Sends each arrival at its time whatever is still running; `stop` ends the sending early."""

    def __init__(self, send: Send, zero: float) -> None:
        self.send = send
        self.zero = zero  # time.perf_counter() at the start of the soak
        self.in_flight = 0
        self.sent = 0
        self.records: list[SoakRecord] = []

    async def run(self, schedule: Sequence[Arrival], stop: asyncio.Event) -> list[SoakRecord]:
        """Every arrival sent (until `stop`), then every answer awaited."""
        tasks = []
        for arrival in schedule:
            delay = self.zero + arrival.at - time.perf_counter()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set():
                break
            tasks.append(asyncio.create_task(self._one(arrival)))
        await asyncio.gather(*tasks)
        return sorted(self.records, key=lambda r: r.start)

    async def _one(self, arrival: Arrival) -> None:
        self.in_flight += 1
        self.sent += 1
        try:
            self.records.append(await self.send(arrival))
        finally:
            self.in_flight -= 1
