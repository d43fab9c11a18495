"""A shared object that a killed compile left short in inductor's cache is removed before compiling again;
whole ones, and files this cannot judge, stay."""

from __future__ import annotations

from pathlib import Path

import torch

from engines.inductor_cache import discard_truncated_libraries, is_truncated_library


def _a_real_library() -> Path:
    """A whole ELF64 shared object on this machine: torch's own c10."""
    found = sorted((Path(torch.__file__).parent / "lib").glob("libc10.so*"))
    assert found, "torch ships libc10"
    return found[0]


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
    kept = cache / "cd" / "kept.main.so"
    kept.write_bytes(whole)
    other = cache / "ab" / "notes.so"  # not ELF, long enough: not judged, kept
    other.write_bytes(b"x" * 100)
    source = cache / "ab" / "graph.main.cpp"
    source.write_bytes(b"")

    assert discard_truncated_libraries(cache) == [empty, cut]
    assert not empty.exists() and not cut.exists()
    assert kept.exists() and other.exists() and source.exists()
    assert discard_truncated_libraries(cache) == []
    assert discard_truncated_libraries(tmp_path / "missing") == []
