"""A build of the CPU kernels waits for another process's build, but not for a dead one's lock."""

from __future__ import annotations

import os
import threading
import time

from engines.paged import cpu_kernel


def test_a_lock_left_by_a_dead_build_is_removed(tmp_path, caplog) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - cpu_kernel.STALE_BUILD_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    cpu_kernel.await_build_lock(tmp_path, poll=0.01)
    assert not lock.exists()
    assert "died while building" in caplog.text


def test_a_live_build_is_waited_for_and_its_lock_left_to_it(tmp_path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    finished = threading.Event()
    lost: list[FileNotFoundError] = []

    def builder() -> None:
        time.sleep(0.2)
        finished.set()
        try:
            lock.unlink()
        except FileNotFoundError as error:  # the waiter had removed the live build's lock
            lost.append(error)

    thread = threading.Thread(target=builder)
    thread.start()
    cpu_kernel.await_build_lock(tmp_path, poll=0.01)
    assert finished.is_set()  # returned only once the builder was done
    thread.join()
    assert not lost


def test_no_lock_no_wait(tmp_path, monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(cpu_kernel.time, "sleep", slept.append)
    cpu_kernel.await_build_lock(tmp_path, stale_after=0.0)
    assert slept == []
