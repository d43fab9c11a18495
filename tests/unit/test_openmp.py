"""The server keeps one OpenMP team (torch work awaited from the event loop runs in a thread that ends
with it) and a short OpenMP spin-wait unless the operator chose one (tgis/openmp.py says why)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from tgis import cli
from tgis.config import Settings
from tgis.openmp import GIL_SWITCH_INTERVAL, SPIN_COUNT, default_spin_count, run_torch_work, short_gil_switch


def test_the_result_comes_back_and_the_thread_is_gone() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert asyncio.run(run_torch_work(work, name="unit-work")) == 42
    (thread,) = seen
    assert thread is not threading.main_thread()
    assert thread.name == "unit-work"
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_an_error_is_raised_in_the_awaiting_task() -> None:
    def work() -> None:
        raise ValueError("no such adapter")

    with pytest.raises(ValueError, match="no such adapter"):
        asyncio.run(run_torch_work(work, name="unit-work"))


def test_a_cancelled_wait_leaves_the_loop_usable() -> None:
    release = threading.Event()

    async def main() -> str:
        task = asyncio.ensure_future(run_torch_work(lambda: release.wait(5), name="unit-work"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()  # the thread finishes after its waiter is gone: nothing is raised on the loop
        await asyncio.sleep(0.05)
        return "still running"

    assert asyncio.run(main()) == "still running"


OPENMP_THREADS_PROBE = textwrap.dedent(
    """
    import asyncio, os, sys, time, torch
    from tgis.openmp import run_torch_work

    big = torch.ones(4_000_000)

    def parallel_op():
        (big * 2).sum()  # large enough for ATen to open an OpenMP parallel region

    def threads():
        time.sleep(0.2)
        return len(os.listdir("/proc/self/task"))

    async def main():
        before = threads()
        if sys.argv[1] == "to_thread":
            await asyncio.to_thread(parallel_op)
        else:
            await run_torch_work(parallel_op, name="probe")
        print(threads() - before)

    asyncio.run(main())
    """
)


def _threads_left_behind(how: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", OPENMP_THREADS_PROBE, how],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_no_openmp_team_outlives_the_work() -> None:
    # The contrast shows the probe sees OpenMP threads: an executor thread keeps its team alive.
    assert _threads_left_behind("to_thread") >= 2  # the executor thread and its OpenMP worker
    assert _threads_left_behind("run_torch_work") == 0


async def _start_with_fakes() -> Any:
    return await cli._start(Settings(model_name="demo"), asyncio.Event())


def test_startup_loads_the_model_and_builds_the_server_off_the_event_loop_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KV pool is allocated (and PT2 warm-up runs) while the server is built: that is torch work too."""
    import tgis.app as app

    where: dict[str, threading.Thread] = {}

    def fake_load_model(settings: object, environ: object) -> str:
        where["load"] = threading.current_thread()
        return "model"

    class FakeServer:
        def __init__(self, settings: object, model: str, **_: object) -> None:
            where["build"] = threading.current_thread()
            self.model = model

        async def start(self) -> None:
            where["start"] = threading.current_thread()

    monkeypatch.setattr(app, "load_model", fake_load_model)
    monkeypatch.setattr(app, "TgisServer", FakeServer)
    server = asyncio.run(_start_with_fakes())
    assert server.model == "model"
    assert where["start"] is threading.main_thread()
    assert where["load"] is where["build"]
    assert where["build"] is not threading.main_thread()
    where["build"].join(timeout=5)
    assert not where["build"].is_alive()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, SPIN_COUNT),
        ({"GOMP_SPINCOUNT": "300000"}, "300000"),  # the operator's choice stands
        ({"OMP_WAIT_POLICY": "active"}, None),  # so does a wait policy, which sets its own spin count
    ],
)
def test_the_spin_count_defaults_short_unless_the_operator_chose(
    environ: dict[str, str], expected: str | None
) -> None:
    default_spin_count(environ)
    assert environ.get("GOMP_SPINCOUNT") == expected


def test_the_launcher_sets_the_spin_count_before_torch_loads() -> None:
    probe = (
        "import os, sys\n"
        "from tgis import cli\n"
        "cli.load_settings = lambda argv, prog: sys.exit(0 if 'torch' not in sys.modules else 3)\n"
        "import atexit\n"
        "atexit.register(lambda: print(os.environ.get('GOMP_SPINCOUNT')))\n"
        "cli.run_server([], 'text-generation-launcher')\n"
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=environ
    )
    assert done.returncode == 0, done.stderr  # torch was not imported yet when the settings load
    assert done.stdout.strip() == SPIN_COUNT


def test_startup_freezes_what_it_built_out_of_later_garbage_collections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    import tgis.app as app

    class FakeServer:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.built = [object() for _ in range(10)]

        async def start(self) -> None:
            pass

    monkeypatch.setattr(app, "load_model", lambda settings, environ: "model")
    monkeypatch.setattr(app, "TgisServer", FakeServer)
    gc.unfreeze()
    try:
        server = asyncio.run(_start_with_fakes())
        assert gc.get_freeze_count() > 0
        built = server.built
        assert not any(obj is built for obj in gc.get_objects())  # in the permanent generation
    finally:
        gc.unfreeze()


def test_a_short_gil_switch_interval_replaces_pythons_default() -> None:
    """A compiled step waits at most about this long for the GIL behind the event loop (tgis/openmp.py)."""
    before = sys.getswitchinterval()
    try:
        short_gil_switch()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL)
    finally:
        sys.setswitchinterval(before)
    assert GIL_SWITCH_INTERVAL < 0.005  # Python's default, which a step waited out behind the loop
