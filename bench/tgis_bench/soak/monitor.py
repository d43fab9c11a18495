"""What the soak watches on the server while it runs: RSS from /proc, KV blocks and failures from /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

KV_BLOCKS = "tgi_kv_cache_blocks"
FAILURES = "tgi_request_failure"


@dataclass(frozen=True)
class Sample:
    """The server at one moment (seconds since the soak began); None where it could not be read."""

    t: float
    rss_bytes: int | None
    kv_used: int | None  # blocks held by requests; None on an engine without KV blocks
    kv_cached: int | None  # blocks kept for prefix reuse, held by no request
    in_flight: int  # the client's requests sent and not yet answered


def parse_vm_rss(status: str) -> int | None:
    """VmRSS from the text of /proc/<pid>/status, in bytes (the kernel writes kB)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            value, _, unit = line.partition(":")[2].strip().partition(" ")
            if unit.strip() != "kB":
                raise ValueError(f"unexpected VmRSS unit in {line!r}")
            return int(value) * 1024
    return None


def read_rss(pid: int) -> int | None:
    """The resident set of a process on this machine, or None once it has gone."""
    try:
        return parse_vm_rss(Path(f"/proc/{pid}/status").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def gauge_by_label(metrics: str, name: str, label: str) -> dict[str, float]:
    """One labelled gauge or counter of a Prometheus text exposition, by the value of `label`."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            # Counters come as <name>_total and, for TGIS dashboards, under the bare name too.
            if sample.name in (name, f"{name}_total") and label in sample.labels:
                values[sample.labels[label]] = sample.value
    return values


def kv_blocks(metrics: str) -> tuple[int | None, int | None]:
    """(used, cached) KV blocks, or (None, None) on an engine without them."""
    states = gauge_by_label(metrics, KV_BLOCKS, "state")
    if "used" not in states:
        return None, None
    cached = states.get("cached")
    return round(states["used"]), None if cached is None else round(cached)


def failure_counts(metrics: str) -> dict[str, int]:
    """The server's own `tgi_request_failure` counters, by `err`."""
    return {err: round(value) for err, value in gauge_by_label(metrics, FAILURES, "err").items()}


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        response.raise_for_status()
        return await response.text()


class Monitor:
    """Samples the server every `interval` seconds until stopped; `pid` None: no RSS (a remote server)."""

    def __init__(
        self,
        metrics_url: str,
        pid: int | None,
        interval: float,
        zero: float,
        in_flight: Callable[[], int],
    ) -> None:
        self.metrics_url = metrics_url
        self.pid = pid
        self.interval = interval
        self.zero = zero  # time.perf_counter() at the start of the soak
        self.in_flight = in_flight
        self.samples: list[Sample] = []

    async def sample(self, session: aiohttp.ClientSession) -> Sample:
        rss = read_rss(self.pid) if self.pid is not None else None
        try:
            used, cached = kv_blocks(await scrape(session, self.metrics_url))
        except (aiohttp.ClientError, TimeoutError) as error:
            logger.warning(f"/metrics did not answer: {error!r}")
            used, cached = None, None
        sample = Sample(time.perf_counter() - self.zero, rss, used, cached, self.in_flight())
        self.samples.append(sample)
        return sample

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self.interval, 5.0))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                await self.sample(session)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
            await self.sample(session)  # the moment the load stopped


_LOG_LINE = re.compile(r"^\S+ \S+ (?:ERROR|CRITICAL) (?P<logger>\S+): (?P<message>.*)$")
_REQUEST_ID = re.compile(r"\s*request_id=\w+$")
_RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:")
_CHAIN_LINES = ("Traceback", "During handling", "The above exception")


def log_errors(log: str) -> dict[str, int]:
    """The ERROR and CRITICAL lines of a server log, counted by logger, message and the exception that
    ends their traceback (if one follows): `aiohttp.server: Error handling request ... → ValueError: ...`."""
    counts: Counter[str] = Counter()
    lines = log.splitlines()
    for index, line in enumerate(lines):
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        key = f"{match['logger']}: {_REQUEST_ID.sub('', match['message'])}"
        raised = _traceback_end(lines, index + 1)
        counts[f"{key} → {raised}" if raised else key] += 1
    return dict(sorted(counts.items()))


def _traceback_end(lines: list[str], start: int) -> str | None:
    """The exception line closing a traceback that starts at `start` (the last one of a chain), without
    its request id; the traceback ends where the next log record begins."""
    if start >= len(lines) or not lines[start].startswith("Traceback"):
        return None
    raised = None
    for line in lines[start + 1 :]:
        if _RECORD_START.match(line):
            break
        if line and not line[0].isspace() and not line.startswith(_CHAIN_LINES):
            raised = _REQUEST_ID.sub("", line)
    return raised
