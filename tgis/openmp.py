"""PyTorch's CPU threads (OpenMP, libgomp on Linux) in a server process that also runs an event loop.

Three things keep the engine step's parallel ops fast there:

- One OpenMP team. libgomp keeps a team of worker threads for every thread that ever ran a parallel
  region, for as long as that thread lives, and once the process holds more OpenMP threads than CPUs it
  stops spinning between parallel regions: each of the step's hundreds of parallel ops then waits for a
  futex wake-up. `asyncio.to_thread`'s executor threads never exit, so a model or adapter loaded there
  leaves a second team behind for good (2 cores: a 16-sequence bf16 decode step took 21 ms instead of
  12). `run_torch_work` runs such work in a thread that exits, and frees its team, with the call.
- A short spin. After a parallel region libgomp's workers spin for about 3 ms (GOMP_SPINCOUNT 300000)
  before they sleep, so through the step's own Python (sampling, detokenizing, planning: 1-3 ms) a
  worker holds a core the event loop and the clients need. `default_spin_count` makes it about 0.5 ms,
  still longer than the gaps between ops within a forward, unless the operator set GOMP_SPINCOUNT or
  OMP_WAIT_POLICY. Measured on 2 cores with the benchmark client beside the server: 800-860 -> 905-917
  tok/s at concurrency 32, token processing 9-12% -> 6-10% of step time; the step alone is unchanged.
- A short GIL switch interval where the step is one compiled graph (`short_gil_switch`, called once
  its warm-up is over). The engine thread needs the GIL for moments inside such a step: the graph's C++
  wrapper releases each input it has done with, and that takes the GIL. When the event loop holds it
  (streaming the last step's tokens), the engine thread, with the step's OpenMP worker idle behind it,
  waits until the loop blocks or Python's switch interval (5 ms) runs out. Measured on 2 cores (AVX-512
  EPYC, Zen 4), GPT-2-small benchmark model, int8 under PT2_COMPILE, against the 5 ms default: one
  stream's ITL p50 0.91x (0.87-0.98, 6 alternated rounds); 32 streams' tokens/s 0.96-1.05x (noise). 0.1
  ms was no faster at one stream and slowed 32 streams (0.69x and 0.94x). An eager step runs Python
  between its operators and holds the GIL for most of its length, so there the loop's earlier turns
  only cost switches: bfloat16 eager at 0.5 ms read 1.06x ITL at one stream (0.995-1.21, 6 rounds)
  and 0.92x tokens/s at 32 streams (0.87-1.11, 10 rounds), and keeps Python's default.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from collections.abc import Callable, MutableMapping
from typing import TypeVar

T = TypeVar("T")

SPIN_COUNT = "50000"  # libgomp's unit: about 100000 spins per millisecond


GIL_SWITCH_INTERVAL = 0.0005  # seconds; Python's default is 0.005


def short_gil_switch() -> None:
    """A thread waiting for the GIL asks its holder to let go after 0.5 ms instead of 5: for a server
    whose steps are whole compiled graphs (see above)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)


def default_spin_count(environ: MutableMapping[str, str]) -> None:
    """Shorten libgomp's spin-wait unless the operator chose one; only works before torch is imported."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_COUNT


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
