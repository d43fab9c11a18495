"""What every peer shares: the interface a peer server implements, starting and stopping it, and the
streamed closed loop that times it exactly as the tgis client times tgis.

A peer is another server a user could pick instead of tgis (vLLM in `peers.vllm`, llama.cpp in
`peers.llamacpp`), run from its own environment, never a tgis dependency: it is started after the tgis
runs on the same machine (tgis idle), sent the same token ids at the same concurrency, and streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from tgis_bench.health import await_health
from tgis_bench.load.client import LoadRun, RequestTiming, closed_loop
from tgis_bench.load.results import PeerResult
from tgis_bench.load.stats import RunSummary, summarize
from tgis_bench.load.workload import BenchRequest, Sweep

logger = logging.getLogger(__name__)

STARTUP_SECONDS = 900.0
STOP_SECONDS = 30.0


@dataclass(frozen=True)
class Progress:
    """What one streamed event says about its request."""

    tokens: int = 0  # generated tokens this event carries
    stop_reason: str | None = None  # in tgis's StopReason names, once the stream says why it ended
    generated: int | None = None  # the server's own count of generated tokens, where the event has it
    input_tokens: int | None = None  # the prompt tokens as the server counted them, likewise


class Peer(Protocol):
    """A peer server: how to start it, and how to ask it for one request and read its stream."""

    @property
    def name(self) -> str:
        """Short, for table headings: `vLLM`, `llama.cpp Q8_0`."""
        ...

    @property
    def endpoint(self) -> str:
        """The path of its streamed completion endpoint."""
        ...

    @property
    def reuses_connections(self) -> bool:
        """Whether a connection stays usable after a streamed answer (else each request opens one)."""
        ...

    def command(self, port: int) -> list[str]: ...

    def environment(self) -> dict[str, str]: ...

    def describe(self) -> tuple[str, str]:
        """Its version, and in words how it serves (for the report); may ask its environment."""
        ...

    def body(self, request: BenchRequest) -> dict[str, Any]:
        """The request as tgis gets it: these exact token ids, greedy, exactly max_new_tokens tokens."""
        ...

    def progress(self, event: dict[str, Any]) -> Progress: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(peer: Peer) -> Iterator[str]:
    """Start the peer, wait until it answers /health, yield its base URL; stop it on exit."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="tgis-peer-", suffix=".log") as log:
        process = subprocess.Popen(
            peer.command(port), env=peer.environment(), stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"
        try:
            await_health(url, process.poll, seconds=STARTUP_SECONDS, name=peer.name, log=Path(log.name))
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def parse_event(line: bytes) -> dict[str, Any] | None:
    """One SSE line: the JSON of a `data:` line, None for anything else (and for `[DONE]`)."""
    text = line.decode().strip()
    if not text.startswith("data:"):
        return None
    payload = text[len("data:") :].strip()
    return None if payload == "[DONE]" else json.loads(payload)


@dataclass
class _Tally:
    """A request's stream as it arrives: the client-side clock and the server's own counts."""

    started: float
    last: float
    first: float | None = None
    counted: int = 0
    gaps: list[float] = dataclasses.field(default_factory=list)
    stop_reason: str = "NOT_FINISHED"
    generated: int | None = None
    input_tokens: int | None = None

    def add(self, step: Progress, now: float) -> None:
        if step.tokens:
            # An event carrying k tokens spreads its gap over them, as the tgis client does.
            if self.first is None:
                self.first = now - self.started
                self.gaps.extend([0.0] * (step.tokens - 1))
            else:
                self.gaps.extend([(now - self.last) / step.tokens] * step.tokens)
            self.counted, self.last = self.counted + step.tokens, now
        self.stop_reason = step.stop_reason or self.stop_reason
        self.generated = self.generated if step.generated is None else step.generated
        self.input_tokens = self.input_tokens if step.input_tokens is None else step.input_tokens


async def _streamed(
    session: aiohttp.ClientSession, url: str, peer: Peer, request: BenchRequest
) -> RequestTiming:
    started = time.perf_counter()
    tally = _Tally(started, started)
    async with session.post(f"{url}{peer.endpoint}", json=peer.body(request)) as response:
        if response.status != 200:
            raise RuntimeError(f"{peer.name} answered {response.status}: {await response.text()}")
        async for line in response.content:
            event = parse_event(line)
            if event is None:
                continue
            if "error" in event:
                raise RuntimeError(f"{peer.name} failed request {request.index}: {event['error']}")
            tally.add(peer.progress(event), time.perf_counter())
    return RequestTiming(
        index=request.index,
        input_tokens=len(request.input_ids) if tally.input_tokens is None else tally.input_tokens,
        asked_tokens=request.max_new_tokens,
        generated_tokens=tally.counted if tally.generated is None else tally.generated,
        stop_reason=tally.stop_reason,
        latency=time.perf_counter() - started,
        ttft=tally.first,
        inter_token=tuple(tally.gaps),
    )


async def run_peer_load(
    url: str, peer: Peer, requests: Sequence[BenchRequest], *, concurrency: int, progress: bool = True
) -> LoadRun:
    """The same closed loop as the tgis client: `concurrency` workers, each sending its next request
    when its previous one ends."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(force_close=not peer.reuses_connections)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        return await closed_loop(
            requests,
            concurrency,
            lambda request: _streamed(session, url, peer, request),
            f"{peer.name} c={concurrency}",
            stream=True,
            progress=progress,
        )


def measure_peer(peer: Peer, sweep: Sweep, *, progress: bool = True) -> PeerResult:
    """Start the peer, warm it with the sweep's short requests, send each level the requests tgis's level
    sent, stop it."""
    version, settings = peer.describe()
    runs: list[RunSummary] = []
    with serving(peer) as url:
        if sweep.warmup:
            asyncio.run(run_peer_load(url, peer, sweep.warmup, concurrency=len(sweep.warmup), progress=False))
        for level, sent in sweep.levels:
            load = asyncio.run(run_peer_load(url, peer, sent, concurrency=level, progress=progress))
            for problem in mismatches(peer.name, sent, load):
                logger.warning(problem)
            runs.append(summarize(load))
    return PeerResult(name=peer.name, version=version, settings=settings, runs=runs)


def mismatches(name: str, requests: Sequence[BenchRequest], load: LoadRun) -> list[str]:
    """Requests whose prompt the peer counted otherwise than it was sent (tokenized again, or a BOS
    added) or that got another number of tokens than asked: the same work as tgis's, or a warning."""
    sent = {request.index: len(request.input_ids) for request in requests}
    problems = []
    for timing in load.requests:
        if timing.input_tokens != sent[timing.index]:
            problems.append(
                f"{name} counted {timing.input_tokens} prompt tokens for request {timing.index}, "
                f"sent {sent[timing.index]}"
            )
        if timing.generated_tokens != timing.asked_tokens:
            problems.append(
                f"{name} generated {timing.generated_tokens} tokens for request {timing.index}, "
                f"asked {timing.asked_tokens}"
            )
    return problems
