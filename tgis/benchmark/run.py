"""One benchmark end to end: warm up, sweep concurrency against the server, then run the baselines."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from tgis.benchmark.baselines import BASELINES, BaselineName, run_baselines
from tgis.benchmark.client import run_load
from tgis.benchmark.llamacpp_peer import LlamaCppPeer
from tgis.benchmark.machine import machine_info
from tgis.benchmark.metrics import scrape, step_shares
from tgis.benchmark.peer import WARMUP_NEW_TOKENS, Peer, measure_peer
from tgis.benchmark.results import BenchmarkResults, model_shape, workload_info
from tgis.benchmark.stats import RunSummary, summarize
from tgis.benchmark.vllm_peer import VllmPeer
from tgis.benchmark.workload import BenchRequest, WorkloadSpec, build_workload
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkConfig:
    """Everything a run needs; the server must already be serving the model in `model_dir`."""

    server: str  # host:port of the gRPC API
    model_dir: Path  # the served model: its tokenizer builds the prompts, the baselines load it
    workload: WorkloadSpec
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    stream: bool = True
    metrics_url: str | None = None  # the server's /metrics; without it no step-time split
    baselines: tuple[BaselineName, ...] = BASELINES
    batch_size: int | None = None  # of the batched baseline; default the highest concurrency
    warmup_requests: int = 2
    progress: bool = True
    dtype: str = "float32"  # what the server runs (for the report, and the vLLM peer is run alike)
    vllm_python: Path | None = None  # a Python with vLLM installed: measure it too, in this run
    llamacpp_python: Path | None = None  # a Python with xllamacpp installed: measure llama.cpp too,
    llamacpp_ggufs: tuple[Path, ...] = ()  # on each of these GGUF conversions of the model

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be positive")
        unknown = set(self.baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; known: {', '.join(BASELINES)}")
        if bool(self.llamacpp_python) != bool(self.llamacpp_ggufs):
            raise ValueError("the llama.cpp peer needs both its Python and at least one GGUF file")


def run_benchmark(config: BenchmarkConfig) -> BenchmarkResults:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    requests = build_workload(tokenizer, config.workload)
    server_info, runs = asyncio.run(_drive_server(config, requests))
    peers = [
        measure_peer(
            peer,
            requests,
            config.concurrency,
            warmup_requests=config.warmup_requests,
            progress=config.progress,
        )
        for peer in peers_of(config, requests)
    ]
    batch_size = config.batch_size or max(config.concurrency)
    baselines = run_baselines(
        config.model_dir, requests, config.baselines, batch_size=batch_size, progress=config.progress
    )
    machine = machine_info()
    return BenchmarkResults(
        created=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine,
        model=model_shape(config.model_dir, config.dtype),
        workload=workload_info(config.workload, requests, stream=config.stream),
        runs=runs,
        baselines=baselines,
        server=server_info,
        peers=peers,
    )


def peers_of(config: BenchmarkConfig, requests: Sequence[BenchRequest]) -> list[Peer]:
    """The peers this run measures, each with room for as many requests as the sweep's top level sends
    at once and for the longest request (tgis idles while they run, one after another)."""
    slots = max(config.concurrency)
    context = max(1024, max(len(r.input_ids) + r.max_new_tokens for r in requests))
    peers: list[Peer] = []
    if config.vllm_python:
        peers.append(
            VllmPeer(
                config.vllm_python, config.model_dir, config.dtype, max_num_seqs=slots, max_model_len=context
            )
        )
    if config.llamacpp_python:
        python = config.llamacpp_python
        peers += [
            LlamaCppPeer.for_gguf(python, gguf_file, slots=slots, slot_context=context)
            for gguf_file in config.llamacpp_ggufs
        ]
    return peers


async def _drive_server(
    config: BenchmarkConfig, requests: Sequence[BenchRequest]
) -> tuple[dict[str, Any], list[RunSummary]]:
    async with grpc.aio.insecure_channel(config.server) as channel:
        info = await pb_grpc.GenerationServiceStub(channel).ModelInfo(pb.ModelInfoRequest())
    server_info = {
        "model_kind": pb.ModelInfoResponse.ModelKind.Name(info.model_kind),
        "max_sequence_length": info.max_sequence_length,
        "max_new_tokens": info.max_new_tokens,
    }
    if config.warmup_requests:
        warmup = [
            dataclasses.replace(r, max_new_tokens=min(r.max_new_tokens, WARMUP_NEW_TOKENS))
            for r in requests[: config.warmup_requests]
        ]
        await run_load(config.server, warmup, concurrency=len(warmup), stream=config.stream, progress=False)
    runs = []
    for concurrency in config.concurrency:
        before = scrape(config.metrics_url) if config.metrics_url else None
        run = await run_load(
            config.server, requests, concurrency=concurrency, stream=config.stream, progress=config.progress
        )
        steps = step_shares(before, scrape(config.metrics_url)) if config.metrics_url and before else None
        runs.append(summarize(run, steps))
        if runs[-1].short_requests:
            logger.warning(f"{runs[-1].short_requests} requests got fewer or more tokens than they asked for")
    return server_info, runs
