"""Torch work awaited from the event loop, run in a thread that ends with the call.

PyTorch's CPU kernels parallelise through OpenMP. libgomp keeps a team of worker threads for every thread
that ever ran a parallel region, for as long as that thread lives, and once the process holds more OpenMP
threads than CPUs it stops spinning between parallel regions: each of the engine's hundreds of parallel
ops per step then waits for a futex wake-up. `asyncio.to_thread`'s executor threads never exit, so a model
or adapter loaded there leaves a second team behind for good (2 cores: a 16-sequence bf16 decode step took
21 ms instead of 12). A thread that exits frees its team, leaving the engine loop's as the only one.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def run_torch_work(fn: Callable[[], T], *, name: str) -> T:
    """`await asyncio.to_thread(fn)`, but in a fresh thread that exits (and frees its OpenMP team)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # the awaiting task was cancelled meanwhile
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        try:
            result = context.run(fn)
        except BaseException as exc:  # handed to the awaiting task, which re-raises it
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=body, name=name, daemon=True).start()
    return await done
