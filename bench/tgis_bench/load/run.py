"""One benchmark end to end: warm up, sweep concurrency against the server, then the peers, the
weights-bandwidth bound and the baselines."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis_bench.baselines.bound import DecodeBound, measure_copy_bandwidth, weight_traffic
from tgis_bench.baselines.common import ALL_BASELINES, BASELINES, BaselineName
from tgis_bench.baselines.plan import BaselinePlan, run_baselines
from tgis_bench.load.client import run_load
from tgis_bench.load.metrics import scrape, speculation_share, step_shares
from tgis_bench.load.results import BenchmarkResults, model_shape, workload_info
from tgis_bench.load.stats import RunSummary, summarize
from tgis_bench.load.workload import BenchRequest, Sweep, WorkloadSpec, build_sweep, build_workload
from tgis_bench.machine import machine_info
from tgis_bench.peers.base import Peer, measure_peer
from tgis_bench.peers.llamacpp import LlamaCppPeer
from tgis_bench.peers.vllm import VllmPeer

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
    llamacpp_server: Path | None = None  # and/or a native llama-server binary,
    llamacpp_ggufs: tuple[Path, ...] = ()  # on each of these GGUF conversions of the model
    requests_per_client: int | None = None  # a level of c clients sends the first requests_per_client × c
    measure_bound: bool = True  # time a device copy for the weights-bandwidth bound
    compile_cpu: bool = False  # compile the static-cache baselines and the decode floor on the CPU too
    floor_batches: tuple[int, ...] = ()  # the torch-alone decode step at these batch sizes
    floor_prompt_tokens: int = 128
    floor_steps: int = 32
    regenerate: str = "make benchmark-report"  # the report names the command that makes it again

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be positive")
        if self.requests_per_client is not None and self.requests_per_client < 1:
            raise ValueError("requests per client must be positive")
        unknown = set(self.baselines) - set(ALL_BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; known: {', '.join(ALL_BASELINES)}")
        if bool(self.llamacpp_python or self.llamacpp_server) != bool(self.llamacpp_ggufs):
            raise ValueError("the llama.cpp peer needs its program (Python or server) and a GGUF file")


def run_benchmark(config: BenchmarkConfig) -> BenchmarkResults:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    requests = build_workload(tokenizer, config.workload)
    sweep = build_sweep(
        tokenizer,
        config.workload,
        requests,
        config.concurrency,
        warmup=config.warmup_requests,
        per_client=config.requests_per_client,
    )
    server_info, runs = asyncio.run(_drive_server(config, sweep))
    peers = [measure_peer(peer, sweep, progress=config.progress) for peer in peers_of(config, requests)]
    bound = measure_bound(config.model_dir, config.dtype) if config.measure_bound else None
    baselines = run_baselines(config.model_dir, requests, baseline_plan(config))
    return BenchmarkResults(
        created=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine_info(),
        model=model_shape(config.model_dir, config.dtype),
        workload=workload_info(
            config.workload,
            requests,
            stream=config.stream,
            per_client=config.requests_per_client,
            timed=sweep.timed,
        ),
        runs=runs,
        baselines=baselines.results,
        server=server_info,
        peers=peers,
        bound=bound,
        decode_floor=baselines.floor,
        baseline_failures=baselines.failures,
        regenerate=config.regenerate,
    )


def measure_bound(model_dir: Path, dtype: str) -> DecodeBound:
    """The bound on the device the baselines use (the server's GPU, or the CPU), the server idle."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DecodeBound(weight_traffic(model_dir, dtype), measure_copy_bandwidth(device))


def baseline_plan(config: BenchmarkConfig) -> BaselinePlan:
    return BaselinePlan(
        names=config.baselines,
        batch_size=config.batch_size or max(config.concurrency),
        dtype=config.dtype,
        per_client=config.requests_per_client,
        compile_cpu=config.compile_cpu,
        floor_batches=config.floor_batches,
        floor_prompt_tokens=config.floor_prompt_tokens,
        floor_steps=config.floor_steps,
        progress=config.progress,
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
    programs = [(config.llamacpp_server, True), (config.llamacpp_python, False)]
    peers += [
        LlamaCppPeer.for_gguf(program, gguf_file, slots=slots, slot_context=context, native=native)
        for program, native in programs
        if program
        for gguf_file in config.llamacpp_ggufs
    ]
    return peers


async def _drive_server(config: BenchmarkConfig, sweep: Sweep) -> tuple[dict[str, Any], list[RunSummary]]:
    async with grpc.aio.insecure_channel(config.server) as channel:
        info = await pb_grpc.GenerationServiceStub(channel).ModelInfo(pb.ModelInfoRequest())
    server_info = {
        "model_kind": pb.ModelInfoResponse.ModelKind.Name(info.model_kind),
        "max_sequence_length": info.max_sequence_length,
        "max_new_tokens": info.max_new_tokens,
    }
    if sweep.warmup:
        await run_load(
            config.server, sweep.warmup, concurrency=len(sweep.warmup), stream=config.stream, progress=False
        )
    runs = []
    for concurrency, sent in sweep.levels:
        before = scrape(config.metrics_url) if config.metrics_url else None
        run = await run_load(
            config.server, sent, concurrency=concurrency, stream=config.stream, progress=config.progress
        )
        after = scrape(config.metrics_url) if config.metrics_url and before else None
        if before is not None and after is not None:
            runs.append(summarize(run, step_shares(before, after), speculation_share(before, after)))
        else:
            runs.append(summarize(run))
        if runs[-1].short_requests:
            logger.warning(f"{runs[-1].short_requests} requests got fewer or more tokens than they asked for")
    return server_info, runs
