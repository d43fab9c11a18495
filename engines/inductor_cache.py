"""What a killed compile leaves in inductor's cache, removed before PT2_COMPILE compiles again.

Inductor builds each compiled graph's shared object straight into its cache (`TORCHINDUCTOR_CACHE_DIR`,
by default under /tmp) and builds it only when that file is missing. A process killed while the linker
writes it (an OOM kill, a failed liveness probe during the warm-up) leaves the file short, and every
later start that compiles the same graph loads it and fails ("file too short"): a server that restarts
on the same disk (under the deployment's read-only-root-filesystem patch /tmp is an emptyDir, kept
across container restarts) never comes up again. Seen here: a test run stopped during a compile left a
0-byte `.so` that failed the next run's compiled int8 test.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

ELF_HEADER_BYTES = 64  # an ELF64 file header
ELF_MAGIC = b"\x7fELF"
ELF_64_BIT = 2  # e_ident[EI_CLASS]
ELF_LITTLE_ENDIAN = 1  # e_ident[EI_DATA]


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


def discard_truncated_libraries(root: Path) -> list[Path]:
    """Remove the truncated shared objects under `root` (inductor then builds them again); returns them."""
    removed = []
    for path in sorted(root.rglob("*.so")) if root.is_dir() else []:
        if is_truncated_library(path):
            path.unlink(missing_ok=True)
            removed.append(path)
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
