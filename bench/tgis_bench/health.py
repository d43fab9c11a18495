"""Waiting for a server the toolkit started (tgis or a peer) to answer /health."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def await_health(
    url: str,
    exit_code: Callable[[], int | None],
    *,
    seconds: float,
    name: str = "the server",
    log: Path | None = None,
    probe_timeout: float = 2.0,
) -> None:
    """Poll `url`/health each second until it answers 200. Raises if the process exits first
    (`exit_code` is not None; the log's tail in the message) or after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        code = exit_code()
        if code is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise RuntimeError(f"{name} exited with status {code} during startup:\n{tail}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/health", timeout=probe_timeout) as r,
        ):
            if r.status == 200:
                return
        time.sleep(1.0)
    where = f" (log: {log})" if log else ""
    raise RuntimeError(f"{name} did not answer /health within {seconds:.0f} s{where}")
