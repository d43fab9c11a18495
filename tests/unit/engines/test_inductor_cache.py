"""A shared object that a killed compile left short in inductor's cache is removed before compiling again;
whole ones, files this cannot judge, and short ones another process may still be writing stay."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engines.inductor_cache import QUIET_SECONDS, discard_truncated_libraries, is_truncated_library


def _a_real_library() -> Path:
    """A whole ELF64 shared object on this machine: torch's own c10."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libc10.so*"))
    assert found, "torch ships libc10"
    return found[0]


def _last_written(path: Path, seconds_ago: float) -> None:
    when = path.stat().st_mtime - seconds_ago
    os.utime(path, (when, when))


def test_a_whole_library_is_not_truncated() -> None:
    library = _a_real_library()
    assert not is_truncated_library(library)


def test_truncated_libraries_are_removed_and_whole_ones_stay(tmp_path) -> None:
    whole = _a_real_library().read_bytes()
    cache = tmp_path / "torchinductor"
    (cache / "ab").mkdir(parents=True)
    (cache / "cd").mkdir()
    empty = cache / "ab" / "empty.main.so"  # what a kill before the linker wrote anything leaves
    empty.write_bytes(b"")
    cut = cache / "cd" / "cut.main.so"  # a kill mid-write: the header is there, the section headers not
    cut.write_bytes(whole[: len(whole) // 2])
    for left in (empty, cut):  # nothing has written to them since the kill
        _last_written(left, QUIET_SECONDS + 5)
    kept = cache / "cd" / "kept.main.so"
    kept.write_bytes(whole)
    other = cache / "ab" / "notes.so"  # not ELF, long enough: not judged, kept
    other.write_bytes(b"x" * 100)
    source = cache / "ab" / "graph.main.cpp"
    source.write_bytes(b"")

    assert discard_truncated_libraries(cache, sleep=_no_wait) == [empty, cut]
    assert not empty.exists() and not cut.exists()
    assert kept.exists() and other.exists() and source.exists()
    assert discard_truncated_libraries(cache, sleep=_no_wait) == []
    assert discard_truncated_libraries(tmp_path / "missing", sleep=_no_wait) == []


def _no_wait(seconds: float) -> None:
    raise AssertionError("nothing here is young enough to wait for")


def test_a_short_library_still_being_written_is_waited_for(tmp_path) -> None:
    """Two processes sharing the cache: one's linker is still writing `finishing` (its writer completes
    it during the wait: kept) while `stalled` was written to just now and never again (removed once it
    has been quiet for QUIET_SECONDS), measured on a clock the waits advance."""
    whole = _a_real_library().read_bytes()
    cache = tmp_path / "torchinductor"
    cache.mkdir()
    finishing = cache / "finishing.wrapper.so"
    finishing.write_bytes(whole[:100])
    stalled = cache / "stalled.wrapper.so"
    stalled.write_bytes(whole[: len(whole) // 3])
    now = [stalled.stat().st_mtime]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds
        if len(waits) == 3:
            finishing.write_bytes(whole)  # its linker wrote the rest

    removed = discard_truncated_libraries(cache, clock=lambda: now[0], sleep=sleep)

    assert removed == [stalled] and not stalled.exists()
    assert finishing.exists() and finishing.read_bytes() == whole
    assert QUIET_SECONDS <= sum(waits) <= QUIET_SECONDS + 2  # until `stalled` had been quiet that long
