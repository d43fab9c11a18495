"""Events from the engine thread reach each request's queue in order, with one event-loop wake-up for
a burst of them instead of one per event."""

from __future__ import annotations

import asyncio
import threading

from tgis.service.delivery import EventDelivery
from tgis.types import GenerationEvent, StopReason, TokenEvent


def token(n: int) -> TokenEvent:
    return TokenEvent(generated_token_count=n, text=str(n), stop_reason=StopReason.NOT_FINISHED)


def test_a_burst_from_the_engine_thread_arrives_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[list[GenerationEvent]], int]:
        loop = asyncio.get_running_loop()
        delivery = EventDelivery(loop)
        wake_ups = 0
        schedule = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            nonlocal wake_ups
            wake_ups += 1
            return schedule(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
        queues: list[asyncio.Queue[GenerationEvent]] = [asyncio.Queue() for _ in range(3)]
        sinks = [delivery.sink(q) for q in queues]
        produced = threading.Event()

        def engine_step() -> None:  # one step's events for 3 rows, 50 steps, while the loop is busy
            for n in range(50):
                for sink in sinks:
                    sink(token(n))
            produced.set()

        threading.Thread(target=engine_step).start()
        produced.wait(10)  # blocks the event loop: nothing is drained meanwhile
        received = [[await asyncio.wait_for(q.get(), 5) for _ in range(50)] for q in queues]
        return received, wake_ups

    received, wake_ups = asyncio.run(main())
    for events in received:
        assert [e.generated_token_count for e in events if isinstance(e, TokenEvent)] == list(range(50))
    assert wake_ups == 1


def test_events_after_a_drain_wake_the_loop_again() -> None:
    async def main() -> list[int]:
        delivery = EventDelivery(asyncio.get_running_loop())
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        put = delivery.sink(queue)
        seen = []
        for n in range(3):  # one event per step, the loop idle in between
            threading.Thread(target=put, args=(token(n),)).start()
            event = await asyncio.wait_for(queue.get(), 5)
            assert isinstance(event, TokenEvent)
            seen.append(event.generated_token_count)
        return seen

    assert asyncio.run(main()) == [0, 1, 2]
