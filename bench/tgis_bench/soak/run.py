"""A soak run end to end: serve (or find) the server, warm up, probe saturation, run the open loop, drain."""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from tgis_bench.load.results import model_shape
from tgis_bench.load.workload import LengthRange, WorkloadSpec, build_workload
from tgis_bench.machine import machine_info
from tgis_bench.soak.client import SoakClient, SoakRecord, SoakTarget
from tgis_bench.soak.load import OpenLoop, Saturation, probe_saturation, warm_up
from tgis_bench.soak.mix import (
    KINDS,
    Arrival,
    KindSpec,
    available_kinds,
    draws,
    poisson_schedule,
    with_weights,
)
from tgis_bench.soak.monitor import Monitor, failure_counts, kv_blocks, log_errors, scrape
from tgis_bench.soak.report import MixEntry, SoakResults
from tgis_bench.soak.server import (
    LORA_ID,
    PREFIX_ID,
    PREFIX_VIRTUAL_TOKENS,
    LaunchSettings,
    ServerHandle,
    launched,
    prepare_model,
    prepare_store,
)
from tgis_bench.soak.windows import Verdicts, is_server_error, kind_stats, rss_drift, unexpected, windows

logger = logging.getLogger(__name__)

DRAIN_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class ExternalServer:
    """A server the soak does not start; `pid` (same machine only) lets it read RSS and see an exit."""

    grpc: str  # host:port
    http: str  # base URL
    pid: int | None = None
    lora: str | None = None  # adapter ids in its store: the kinds that need one are left out without
    prefix: str | None = None


@dataclass(frozen=True)
class SoakConfig:
    minutes: float
    model_dir: Path | None = None  # None: the benchmark model (built once)
    external: ExternalServer | None = None  # None: the soak launches its own server
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    server_log: Path | None = None  # where the launched server's output goes (default: discarded)
    window_seconds: float = 300.0
    sample_seconds: float = 5.0
    load: float = 0.8  # share of the measured saturation throughput
    rate: float | None = None  # requests/s; given, no saturation probe
    probe_seconds: float = 60.0
    probe_concurrency: int | None = None  # default twice the launched server's batch size, else 32
    prompt_tokens: LengthRange = field(default_factory=lambda: LengthRange(16, 96))
    new_tokens: LengthRange = field(default_factory=lambda: LengthRange(16, 64))
    prompts: int = 64
    seed: int = 0
    weights: Mapping[str, float] = field(default_factory=dict)
    time_limit_ms: int = 500
    deadline_ms: int = 800
    request_timeout: float = 300.0
    drain_seconds: float = 30.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.window_seconds <= 0 or self.sample_seconds <= 0:
            raise ValueError("minutes, window and sample seconds must be positive")
        if not 0 < self.load <= 1.5:
            raise ValueError(f"load is a share of saturation, 0 < load <= 1.5; got {self.load}")
        with_weights(KINDS, self.weights)  # unknown kinds fail here, before any model loads

    @property
    def seconds(self) -> float:
        return self.minutes * 60


@dataclass(frozen=True)
class Served:
    """What the soak knows of the server it drives."""

    handle: ServerHandle
    model_dir: Path  # the model it serves (its tokenizer builds the prompts)
    lora: str | None
    prefix: str | None
    chat: bool  # whether its tokenizer has a chat template
    description: dict[str, Any]
    log: Path | None = None  # the launched server's output, scanned for ERROR lines at the end


def run_soak(config: SoakConfig) -> SoakResults:
    from transformers import AutoTokenizer

    from tgis_bench.models.build import ensure_bench_model

    model_dir = config.model_dir or ensure_bench_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = WorkloadSpec(config.prompts, config.prompt_tokens, LengthRange(1, 1), config.seed)
    prompts = [request.text for request in build_workload(tokenizer, spec)]
    if config.external is not None:
        return asyncio.run(_soak(config, external(config.external, model_dir, tokenizer), prompts))
    with tempfile.TemporaryDirectory(prefix="tgis-soak-") as work:
        served_dir = prepare_model(model_dir, Path(work) / "model")
        store = Path(work) / "store"
        logger.info("Writing the adapter store (a PEFT LoRA and a PEFT prompt-tuning prefix)")
        prepare_store(served_dir, store, config.seed)
        log = config.server_log or Path(work) / "server.log"
        logger.info("Starting the server")
        with launched(served_dir, store, config.launch, log) as handle:
            served = Served(handle, model_dir, LORA_ID, PREFIX_ID, True, launched_description(config), log)
            return asyncio.run(_soak(config, served, prompts))


def external(server: ExternalServer, model_dir: Path, tokenizer: Any) -> Served:
    handle = ServerHandle(server.grpc, server.http, server.pid)
    rss = (
        "VmRSS of the `--server-pid` process's /proc/<pid>/status"
        if server.pid
        else "not measured (an external server without `--server-pid`)"
    )
    description = {
        "how": "external (started by the operator; the soak did not choose its settings)",
        "settings": {},
        "rss": rss,
        "adapters": ", ".join(f"`{a}`" for a in (server.lora, server.prefix) if a) or "none given",
    }
    chat = bool(getattr(tokenizer, "chat_template", None))
    return Served(handle, model_dir, server.lora, server.prefix, chat, description)


def launched_description(config: SoakConfig) -> dict[str, Any]:
    return {
        "how": "launched by the soak as a child process (`text-generation-launcher` of the same install)",
        "settings": config.launch.described(),
        "rss": "VmRSS of the server process's /proc/<pid>/status",
        "adapters": f"a PEFT LoRA `{LORA_ID}` (r = 4, on the attention projections) and a PEFT "
        f"prompt-tuning prefix `{PREFIX_ID}` ({PREFIX_VIRTUAL_TOKENS} virtual tokens), written with peft "
        "into a fresh `PREFIX_STORE_PATH`",
    }


async def _soak(config: SoakConfig, served: Served, prompts: Sequence[str]) -> SoakResults:
    kinds = available_kinds(
        with_weights(KINDS, config.weights),
        lora=served.lora is not None,
        prefix=served.prefix is not None,
        chat=served.chat,
    )
    model, dtype = await server_facts(served.handle.http)
    target = soak_target(config, served, model)
    expected = {k.name: k.expected for k in KINDS}
    async with SoakClient(target, prompts, time.perf_counter()) as client:
        logger.info(f"Warming up: one request of each of {len(kinds)} kinds")
        await warm_up(client.send, [k.name for k in kinds], expected)
    saturation = None if config.rate is not None else await probe(config, target, prompts, kinds)
    rate = config.rate if config.rate is not None else config.load * saturation_rate(saturation)
    schedule = poisson_schedule(
        rate, config.seconds, kinds, prompts=len(prompts), new_tokens=config.new_tokens, seed=config.seed
    )
    metrics_url = f"{served.handle.http}/metrics"
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = failure_counts(await scrape(session, metrics_url))
    logger.info(f"Soaking for {config.minutes:g} min at {rate:.2f} requests/s ({len(schedule)} requests)")
    run = await drive(config, served, target, prompts, schedule)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        drained = await drain(session, metrics_url, config.drain_seconds) if run.exits != 1 else (None, None)
        after = failure_counts(await scrape(session, metrics_url)) if run.exits != 1 else before
    failures = {err: after.get(err, 0) - before.get(err, 0) for err in sorted(after)}
    errors = log_errors(served.log.read_text(errors="replace")) if served.log else None
    return results(config, served, dtype, kinds, saturation, rate, run, drained, (failures, errors))


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        response.raise_for_status()
        return await response.json()


async def server_facts(http: str) -> tuple[str, str]:
    """(the base model's OpenAI name: the first entry of /v1/models, its dtype from TGI's /info)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        models = await get_json(session, f"{http}/v1/models")
        info = await get_json(session, f"{http}/info")
    return str(models["data"][0]["id"]), f"{info['model_dtype']} on {info['model_device_type']}"


def soak_target(config: SoakConfig, served: Served, model: str) -> SoakTarget:
    handle = served.handle
    return SoakTarget(
        grpc=handle.grpc,
        http=handle.http,
        model=model,
        lora=served.lora,
        prefix=served.prefix,
        time_limit_ms=config.time_limit_ms,
        deadline_ms=config.deadline_ms,
        timeout=config.request_timeout,
    )


async def probe(
    config: SoakConfig, target: SoakTarget, prompts: Sequence[str], kinds: Sequence[KindSpec]
) -> Saturation:
    concurrency = config.probe_concurrency or (
        2 * config.launch.max_batch_size if config.external is None else 32
    )
    logger.info(f"Probing saturation: {concurrency} clients in a closed loop for {config.probe_seconds:g} s")
    rng = random.Random(config.seed + 2)
    mix = draws(kinds, rng, prompts=len(prompts), new_tokens=config.new_tokens)
    zero = time.perf_counter()
    async with SoakClient(target, prompts, zero) as client:
        saturation = await probe_saturation(
            client.send, mix, concurrency=concurrency, seconds=config.probe_seconds, zero=zero
        )
    logger.info(
        f"Saturation: {saturation.requests_per_second:.2f} requests/s, "
        f"{saturation.tokens_per_second:.1f} tokens/s"
    )
    return saturation


def saturation_rate(saturation: Saturation | None) -> float:
    if saturation is None or saturation.requests == 0:
        raise RuntimeError("the saturation probe got no answer in its time: give --rate or a longer probe")
    return saturation.requests_per_second


@dataclass(frozen=True)
class Run:
    """The open loop's outcome: every request, the server samples, how long it sent, whether it exited."""

    records: list[SoakRecord]
    monitor: Monitor
    seconds: float
    exits: int | None  # None: an external server that is not watched
    exit_code: int | None


async def drive(
    config: SoakConfig,
    served: Served,
    target: SoakTarget,
    prompts: Sequence[str],
    schedule: Sequence[Arrival],
) -> Run:
    """The open loop with the monitor sampling beside it and a watch on the server process."""
    handle = served.handle
    zero = time.perf_counter()
    stop_sending, stop_sampling = asyncio.Event(), asyncio.Event()
    async with SoakClient(target, prompts, zero) as client:
        loop = OpenLoop(client.send, zero)
        monitor = Monitor(
            f"{handle.http}/metrics", handle.pid, config.sample_seconds, zero, lambda: loop.in_flight
        )
        sampling = asyncio.create_task(monitor.run(stop_sampling))
        watch = asyncio.create_task(watch_server(handle, stop_sending))
        progress = asyncio.create_task(log_progress(loop, monitor, config)) if config.progress else None
        records = await loop.run(schedule, stop_sending)
        sent_for = min(time.perf_counter() - zero, config.seconds)
        stop_sampling.set()
        await sampling
        for task in (watch, progress):
            if task is not None:
                task.cancel()
    exit_code = handle.exit_code()
    watched = handle.process is not None or handle.pid is not None
    exits = (1 if not handle.alive() else 0) if watched else None
    if exits:
        logger.error(f"The server exited during the soak (status {exit_code})")
    return Run(records, monitor, sent_for, exits, exit_code)


async def watch_server(handle: ServerHandle, stop: asyncio.Event) -> None:
    """Stop sending once the server process has gone."""
    while handle.alive():
        await asyncio.sleep(1.0)
    stop.set()


async def log_progress(loop: OpenLoop, monitor: Monitor, config: SoakConfig) -> None:
    every = min(60.0, config.window_seconds)
    while True:
        await asyncio.sleep(every)
        last = monitor.samples[-1] if monitor.samples else None
        rss = f"{last.rss_bytes / 2**20:.0f} MiB" if last and last.rss_bytes else "n/a"
        kv = last.kv_used if last else None
        logger.info(
            f"{last.t if last else 0:.0f}/{config.seconds:.0f} s: {loop.sent} sent, {len(loop.records)} "
            f"answered, {loop.in_flight} in flight; RSS {rss}, KV blocks in use {kv}"
        )


async def drain(
    session: aiohttp.ClientSession, metrics_url: str, seconds: float
) -> tuple[int | None, float | None]:
    """(KV blocks in use, seconds until they reached 0), polled after the last answer for up to `seconds`;
    (None, None) on an engine without KV blocks."""
    started = time.perf_counter()
    while True:
        used, _ = kv_blocks(await scrape(session, metrics_url))
        waited = time.perf_counter() - started
        if used is None or used == 0:
            return used, None if used is None else waited
        if waited >= seconds:
            return used, None
        await asyncio.sleep(DRAIN_POLL_SECONDS)


def results(
    config: SoakConfig,
    served: Served,
    dtype: str,
    kinds: Sequence[KindSpec],
    saturation: Saturation | None,
    rate: float,
    run: Run,
    drained: tuple[int | None, float | None],
    server_side: tuple[dict[str, int], dict[str, int] | None],
) -> SoakResults:
    """`server_side`: the server's tgi_request_failure deltas, and its log's ERROR lines (when launched)."""
    series = windows(run.records, run.monitor.samples, run.seconds, config.window_seconds)
    drift, peak = rss_drift(series)
    odd = unexpected(run.records, {k.name: k.expected for k in KINDS})
    verdicts = Verdicts(
        rss_drift=drift,
        rss_peak_growth=peak,
        server_exits=run.exits,
        server_errors=sum(is_server_error(r.code) for r in run.records),
        unexpected=sum(odd.values()),
        kv_used_at_end=drained[0],
        kv_drain_seconds=drained[1],
    )
    notes = [] if run.exits != 1 else [f"The server exited during the soak with status {run.exit_code}."]
    return SoakResults(
        created=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine_info(),
        model=model_shape(served.model_dir, dtype),
        server=served.description,
        settings=soak_settings(config, served),
        mix=[MixEntry(k.name, k.transport, k.weight, sorted(k.expected)) for k in kinds],
        saturation=saturation,
        rate=rate,
        seconds=run.seconds,
        requests=len(run.records),
        windows=series,
        kinds=kind_stats(run.records),
        codes=dict(sorted(_codes(run.records).items())),
        unexpected=odd,
        server_failures=server_side[0],
        server_log_errors=server_side[1],
        verdicts=verdicts,
        notes=notes,
        samples=run.monitor.samples,
    )


def _codes(records: Sequence[SoakRecord]) -> dict[str, int]:
    return dict(Counter(record.code for record in records))


def soak_settings(config: SoakConfig, served: Served) -> dict[str, Any]:
    return {
        "minutes": config.minutes,
        "window_seconds": config.window_seconds,
        "sample_seconds": config.sample_seconds,
        "load": config.load if config.rate is None else None,
        "rate": config.rate,
        "probe_seconds": config.probe_seconds if config.rate is None else None,
        "prompt_tokens": str(config.prompt_tokens),
        "new_tokens": str(config.new_tokens),
        "prompts": config.prompts,
        "seed": config.seed,
        "time_limit_ms": config.time_limit_ms,
        "deadline_ms": config.deadline_ms,
        "request_timeout": config.request_timeout,
        "drain_seconds": config.drain_seconds,
        "chat": served.chat,
    }
