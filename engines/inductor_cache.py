"""What a killed compile leaves in inductor's cache, removed before PT2_COMPILE compiles again.

Inductor builds each compiled graph's shared object straight into its cache (`TORCHINDUCTOR_CACHE_DIR`,
by default under /tmp) and builds it only when that file is missing. A process killed while the linker
writes it (an OOM kill, a failed liveness probe during the warm-up) leaves the file short, and every
later start that compiles the same graph loads it and fails ("file too short"): a server that restarts
on the same disk (under the deployment's read-only-root-filesystem patch /tmp is an emptyDir, kept
across container restarts) never comes up again. Seen here: a test run stopped during a compile left a
0-byte `.so` that failed the next run's compiled int8 test.

A short file may also be another process's compile still in progress: two servers, or two test
workers, sharing the cache. The linker creates its output before it writes it, so removing a short file
can pull it from under that process's link and fail its compile: the likeliest cause of a CI run in
which an AOTInductor export found its `wrapper.so` gone ("is not a valid file path") while the other
test worker started compiling. A short file is therefore
removed only once nothing has written to it for QUIET_SECONDS; a younger one is waited for until it is
whole (kept) or that quiet (removed).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

ELF_HEADER_BYTES = 64  # an ELF64 file header
ELF_MAGIC = b"\x7fELF"
ELF_64_BIT = 2  # e_ident[EI_CLASS]
ELF_LITTLE_ENDIAN = 1  # e_ident[EI_DATA]
QUIET_SECONDS = 60.0  # a linker writing a shared object does not pause this long


def is_truncated_library(path: Path) -> bool:
    """Whether the shared object at `path` stops short of what its header describes: shorter than an
    ELF64 header, or than its section header table, which the linker writes last. A file this cannot
    judge (not ELF64, unreadable) counts as whole."""
    try:
        size = path.stat().st_size
        with path.open("rb") as library:
            header = library.read(ELF_HEADER_BYTES)
    except OSError:
        return False
    if size < ELF_HEADER_BYTES:
        return True
    if header[:4] != ELF_MAGIC or header[4] != ELF_64_BIT:
        return False
    order: Literal["little", "big"] = "little" if header[5] == ELF_LITTLE_ENDIAN else "big"
    section_headers_at = int.from_bytes(header[0x28:0x30], order)
    section_header_size = int.from_bytes(header[0x3A:0x3C], order)
    section_headers = int.from_bytes(header[0x3C:0x3E], order)
    return size < section_headers_at + section_header_size * section_headers


def discard_truncated_libraries(
    root: Path,
    quiet_seconds: float = QUIET_SECONDS,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Path]:
    """Remove the truncated shared objects under `root` (inductor then builds them again); returns them.
    One written to within `quiet_seconds` may still be another process's: it is checked again every
    second until it is whole (kept), gone, or unwritten that long (removed)."""
    removed: list[Path] = []
    announced = False
    pending = sorted(root.rglob("*.so")) if root.is_dir() else []
    while pending:
        waiting = []
        for path in pending:
            try:
                quiet_for = clock() - path.stat().st_mtime
            except OSError:  # gone: its own process removed or replaced it
                continue
            if not is_truncated_library(path):  # whole, or its writer finished it
                continue
            if quiet_for >= quiet_seconds:
                path.unlink(missing_ok=True)
                removed.append(path)
            else:
                waiting.append(path)
        if waiting and not announced:
            announced = True
            logger.info(
                f"PT2_COMPILE: waiting for {len(waiting)} short compiled kernel(s) in inductor's cache "
                f"{root} that another process may still be writing (removed once unwritten for "
                f"{quiet_seconds:.0f} s)"
            )
        pending = waiting
        if pending:
            sleep(1.0)
    if removed:
        logger.warning(
            f"PT2_COMPILE: removed {len(removed)} truncated compiled kernel(s) from inductor's cache {root} "
            "(left by a process stopped mid-compile); they are compiled again"
        )
    return removed


@functools.cache
def clean_inductor_cache() -> None:
    """`discard_truncated_libraries` on inductor's cache directory, once a process."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    discard_truncated_libraries(Path(cache_dir()))
