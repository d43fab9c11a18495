"""The composition root: loads the model, then assembles the engine loop, service core and front doors."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
import torch
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engines.base import Engine, EngineConfig, EngineSpec
from engines.compiled import warm_up, warm_up_steps
from engines.registry import load_engine
from engines.step import PagedEngine
from tgis import __version__
from tgis.adapters.loading import model_hidden_size
from tgis.adapters.store import AdapterStore
from tgis.batching.admission import Admission
from tgis.batching.batch_weights import warmup_shapes
from tgis.batching.blocks import BlockPool
from tgis.batching.paged import PagedPlanner
from tgis.config import (
    ServingLimits,
    Settings,
    StartupError,
    effective_limits,
    hub_cache_dir,
    max_prefix_length,
    shard_count,
)
from tgis.engine_loop.core import EngineLoop
from tgis.engine_loop.observer import LoopMetrics
from tgis.engine_loop.outputs import OutputProcessor
from tgis.engine_loop.padded_runner import PaddedRunner
from tgis.engine_loop.paged_runner import PagedRunner
from tgis.guided import GrammarCache
from tgis.http.api import HttpApi
from tgis.http.frontend import Frontend
from tgis.http.gateway import GatewayLoadCollector
from tgis.http.openai import OpenAIRoutes
from tgis.http.server import HttpServer
from tgis.http.tgi import TgiRoutes
from tgis.hub import resolve_model_path
from tgis.metrics import Metrics
from tgis.model_choice import DEMO_MODEL_NAME, log_demo_choice, wants_demo_model
from tgis.pb import generation_pb2 as pb
from tgis.quantization import check_quantization
from tgis.rpc.decoding import add_generation_service
from tgis.rpc.servicer import GenerationServicer
from tgis.service.context import ServiceContext
from tgis.service.health import LIVENESS_TEXT, DrainGate, HealthChecker
from tgis.service.permits import Permits
from tgis.startup import kv_pool, memory
from tgis.startup.cuda_memory import cap_cuda_memory
from tgis.startup.fit import check_max_length_fits
from tgis.tls import TlsFiles, http_ssl_context, load_tls
from tgis.tokenization.tokenizer import Tokenizer
from tgis.tracing import Tracing, create_tracing
from tgis.types import GenerationHealth

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_SERVICES = ("", SERVICE_NAME)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Without this, Linux lets a second server bind the same gRPC port and silently share its traffic.
GRPC_OPTIONS = (("grpc.so_reuseport", 0),)
# After the drain, calls still open (e.g. health Watch streams) get this long before they are cut.
FINAL_GRPC_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class LoadedModel:
    path: Path
    engine: Engine | PagedEngine  # spec.paged tells which
    tokenizer: Tokenizer


def load_model(settings: Settings, environ: Mapping[str, str]) -> LoadedModel:
    """Resolve the model offline (or build the demo model), then load engine and tokenizer."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the weight-loading bar: no progress bars in a server log
    if wants_demo_model(settings, environ):
        from tgis.demo_model import ensure_demo_model

        path = ensure_demo_model()
        log_demo_choice(settings, environ, path)
    else:
        assert settings.model_name is not None
        path = resolve_model_path(
            settings.model_name, revision=settings.revision, cache_dir=hub_cache_dir(environ)
        )
    check_quantization(
        settings.quantize,
        framework=settings.deployment_framework,
        model_config=json.loads((path / "config.json").read_text()),
        cuda=torch.cuda.is_available(),
    )
    engine = load_engine(
        settings.deployment_framework,
        EngineConfig(
            model_path=path,
            dtype=settings.dtype_name,
            trust_remote_code=settings.trust_remote_code,
            attn_implementation=settings.transformers_attn_impl,
            num_shards=shard_count(settings, environ),
            master_addr=settings.master_addr,
            master_port=settings.master_port,
            compile=settings.pt2_compile,
            paged=settings.paged_step,
            cpu_bf16=True,  # DTYPE unset on a CPU with native bf16: bfloat16 (logged)
        ),
    )
    cap_cuda_memory(settings.cuda_process_memory_fraction, engine.spec.device)
    tokenizer = Tokenizer.load(
        path,
        trust_remote_code=settings.trust_remote_code,
        output_special_tokens=settings.output_special_tokens,
    )
    return LoadedModel(path, engine, tokenizer)


def adapter_store(
    settings: Settings, spec: EngineSpec, limits: ServingLimits, metrics: Metrics
) -> AdapterStore | None:
    """The prefix/adapter store of SPEC §8, when PREFIX_STORE_PATH (or ADAPTER_CACHE) is set."""
    limit = max_prefix_length(settings, limits.max_sequence_length)  # checked even without a store
    if settings.prefix_store_path is None:
        return None
    root = Path(settings.prefix_store_path)
    if not root.is_dir():
        raise StartupError(f"PREFIX_STORE_PATH {root} is not a directory")
    store = AdapterStore(
        root,
        is_encoder_decoder=spec.is_encoder_decoder,
        hidden_size=model_hidden_size(spec.model_config),
        dtype=spec.dtype,
        device=spec.device,
        max_prefix_length=limit,
        cache_size_mb=settings.prompt_cache_size_mb,
        metrics=metrics,
    )
    logger.info(
        f"Adapter store at {root}: prefixes up to {limit} tokens, {settings.prompt_cache_size_mb} MiB cache"
    )
    return store


def default_tokenization_workers(shards: int = 1) -> int:
    return min(max((os.cpu_count() or 1) - shards, 1), 8)


def _bind_failure(port: int) -> str:
    """Why the gRPC port could not be bound, found by trying it with a plain socket."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"gRPC port {port} is already in use"
            if exc.errno != errno.EAFNOSUPPORT:
                return f"could not listen on gRPC port {port}: {exc.strerror}"
    return f"could not listen on gRPC port {port}"


class TgisServer:
    """One serving process; `start` binds the ports (0 picks free ones), `stop` drains and shuts down.

    `tls` and `tracing` default to what the settings say; the launcher passes TLS files it has already
    read (to fail before loading the model), tests pass an in-memory tracer.
    """

    def __init__(
        self,
        settings: Settings,
        model: LoadedModel,
        *,
        tls: TlsFiles | None = None,
        tracing: Tracing | None = None,
        shards: int = 1,
    ) -> None:
        self.settings = settings
        self.model = model
        self.tls = tls if tls is not None else load_tls(settings)
        self.tracing = tracing or create_tracing(settings.otlp_endpoint, settings.otel_service_name)
        spec = model.engine.spec
        self.limits = effective_limits(settings, spec.model_config)
        self.metrics = Metrics(
            max_sequence_length=self.limits.max_sequence_length,
            max_new_tokens=self.limits.max_new_tokens,
            max_batch_size=settings.max_batch_size,
        )
        self.metrics.set_build_info(
            version=__version__,
            engine=spec.engine_name,
            dtype=str(spec.dtype).removeprefix("torch."),
            model=settings.model_name or DEMO_MODEL_NAME,
        )
        self.fatal: BaseException | None = None
        self.adapters = adapter_store(settings, spec, self.limits, self.metrics)
        self.engine_loop = self._engine_loop()
        self._executor = ThreadPoolExecutor(
            settings.tokenization_workers or default_tokenization_workers(shards),
            thread_name_prefix="tokenize",
        )
        self.drain = DrainGate()
        self.health = health.aio.HealthServicer()
        self.health_checker: HealthChecker | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.http: HttpServer | None = None
        self.grpc_port = 0
        self.http_port = 0
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task[None]] = set()

    def _padded_runner(self, metrics: LoopMetrics, eos: tuple[int, ...]) -> PaddedRunner:
        settings, engine = self.settings, cast(Engine, self.model.engine)
        weights = memory.estimate(settings, engine, self.limits)  # SPEC §9.4: after the load
        check_max_length_fits(weights, self.limits.max_sequence_length)
        if settings.pt2_compile:  # SPEC §7: compile every shape the weights admit before serving
            shapes = warmup_shapes(weights, self.limits.max_sequence_length, settings.max_batch_size)
            hidden = model_hidden_size(engine.spec.model_config) if self.adapters is not None else None
            warm_up(engine, [*shapes, (1, 1), (2, 2)], prefix_hidden_size=hidden)
        admission = Admission(settings.max_batch_size, settings.max_waiting_tokens, weights)
        return PaddedRunner(engine, admission, eos, metrics)

    def _paged_runner(self, metrics: LoopMetrics, eos: tuple[int, ...]) -> PagedRunner:
        """The paged step: a KV pool sized once from the memory, admission counted in its blocks."""
        settings = self.settings
        engine = cast(PagedEngine, self.model.engine)
        pool_size = kv_pool.size_pool(settings, engine.spec, engine.kv_shape, self.limits)
        probe = self.model.tokenizer.encode(LIVENESS_TEXT).ids
        reserved = -(-len(probe) // pool_size.block_size)
        weights = kv_pool.admission_weights(settings, pool_size, reserved)
        check_max_length_fits(weights, self.limits.max_sequence_length)
        engine.allocate(pool_size.num_blocks, pool_size.block_size)
        if settings.pt2_compile:  # compile every graph serving uses before serving
            hidden = model_hidden_size(engine.spec.model_config) if self.adapters is not None else None
            warm_up_steps(
                engine,
                settings.max_step_tokens,
                pool_size.block_size,
                pool_size.num_blocks,
                prefix_hidden_size=hidden,
            )
        per_block = engine.kv_shape.bytes_per_block(pool_size.block_size)
        logger.info(
            f"Paged KV cache: {pool_size.num_blocks} blocks of {pool_size.block_size} positions "
            f"({pool_size.num_blocks * per_block / kv_pool.MIB:.0f} MiB, from {pool_size.source}); "
            f"up to {settings.max_step_tokens} tokens per step; prefix caching "
            f"{'on' if settings.prefix_caching else 'off'}; one step may use about "
            f"{kv_pool.step_overhead_bytes(settings, engine.spec) / kv_pool.MIB:.0f} MiB beyond the pool"
        )
        if settings.estimate_memory != "auto":
            logger.warning(f"ESTIMATE_MEMORY={settings.estimate_memory} has no effect on the paged step")
        pool = BlockPool(pool_size.num_blocks, pool_size.block_size, prefix_caching=settings.prefix_caching)
        admission = Admission(settings.max_batch_size, settings.max_waiting_tokens, weights)
        return PagedRunner(engine, admission, PagedPlanner(pool, settings.max_step_tokens), eos, metrics)

    def _engine_loop(self) -> EngineLoop:
        """The engine loop over the runner the engine calls for (paged or padded)."""
        metrics = LoopMetrics(self.metrics)
        outputs = OutputProcessor(self.model.tokenizer, self.model.engine.spec, metrics)
        eos = outputs.eos_token_ids
        runner = (
            self._paged_runner(metrics, eos)
            if self.model.engine.spec.paged
            else self._padded_runner(metrics, eos)
        )
        return EngineLoop(
            runner,
            outputs,
            metrics,
            on_fatal=self._on_fatal,
            on_health=self._on_generation_health,
            evicted_loras=None if self.adapters is None else self.adapters.drain_evicted_loras,
        )

    def _context(self) -> ServiceContext:
        spec = self.model.engine.spec
        return ServiceContext(
            engine_loop=self.engine_loop,
            spec=spec,
            tokenizer=self.model.tokenizer,
            metrics=self.metrics,
            limits=self.limits,
            permits=Permits(self.settings.max_concurrent_requests),
            tokenization_executor=self._executor,
            default_include_stop_seqs=self.settings.default_include_stop_seqs,
            compiled=self.settings.pt2_compile,
            adapters=self.adapters,
            drain=self.drain,
            tracing=self.tracing,
            grammars=GrammarCache(
                self.model.tokenizer.hf,
                vocab_size=spec.vocab_size,
                stop_token_ids=self.engine_loop.outputs.eos_token_ids,
                tokenizer_key=str(self.settings.model_name),
                metrics=self.metrics,
            ),
        )

    async def start(self) -> None:
        """Start the loop, then gRPC, then HTTP; on any failure undo what started and re-raise."""
        self._aio_loop = asyncio.get_running_loop()
        liveness = await asyncio.to_thread(self.model.tokenizer.encode, LIVENESS_TEXT)
        self.health_checker = HealthChecker(
            self.engine_loop,
            liveness.ids,
            self.model.engine.spec.device,
            failed=lambda: self.fatal is not None,
        )
        self.engine_loop.start()
        try:
            context = self._context()
            await self._start_grpc(context)
            self.http = self._http_server(context)
            self.http_port = await self.http.start(self.settings.port)
        except BaseException:
            await self.stop(grace=0)
            raise
        security = "TLS" if self.http.ssl_context is not None else "plaintext"
        logger.info(
            f"HTTP server (health, metrics, OpenAI, TGI) listening on port {self.http_port} ({security})"
        )

    def _http_server(self, context: ServiceContext) -> HttpServer:
        """Health and metrics, plus the OpenAI and TGI routes on the gRPC side's context (same permits)."""
        settings = self.settings
        assert self.health_checker is not None
        served = settings.served_model_name or settings.model_name or "demo"
        frontend = Frontend(context, served)
        # Every running request may use its own adapter: the batch size bounds the distinct ones.
        self.metrics.registry.register(
            GatewayLoadCollector(self.engine_loop.load, served, settings.max_batch_size)
        )
        api = HttpApi(frontend, api_key=settings.api_key, request_timeout=settings.http_request_timeout)
        openai = OpenAIRoutes(frontend, api)
        tgi = TgiRoutes(frontend, api, (settings.watermark_gamma, settings.watermark_delta))

        def routes(app: web.Application) -> None:
            openai.add_to(app)
            tgi.add_to(app)

        ssl_context = None
        if settings.http_tls:
            if self.tls is None:
                raise StartupError("HTTP_TLS needs TLS_CERT_PATH and TLS_KEY_PATH")
            ssl_context = http_ssl_context(settings, self.tls)
        return HttpServer(
            self.health_checker,
            self.metrics,
            api=api,
            routes=routes,
            ssl_context=ssl_context,
            max_body_bytes=settings.http_max_body_bytes,
        )

    async def _start_grpc(self, context: ServiceContext) -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        self.grpc_server = server
        add_generation_service(GenerationServicer(context), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"[::]:{self.settings.grpc_port}"
        try:
            if self.tls is None:
                self.grpc_port = server.add_insecure_port(address)
            else:
                self.grpc_port = server.add_secure_port(address, self.tls.server_credentials())
        except RuntimeError as exc:  # grpc says only "Failed to bind": find out why for the operator
            raise StartupError(_bind_failure(self.settings.grpc_port)) from exc
        await server.start()
        await self._sync_grpc_health()
        security = "plaintext" if self.tls is None else "mutual TLS" if self.tls.mutual else "TLS"
        logger.info(f"gRPC server listening on port {self.grpc_port} ({security})")

    # ---- serving state ------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """What grpc.health.v1 reports: loaded, not draining, loop alive, last forward pass not failed."""
        return (
            not self.drain.closed
            and self.fatal is None
            and self.engine_loop.alive
            and self.engine_loop.generation_health != GenerationHealth.FAILED
        )

    async def _sync_grpc_health(self) -> None:
        status = SERVING if self.serving else NOT_SERVING
        for name in HEALTH_SERVICES:
            await self.health.set(name, status)

    def _resync_from_loop_thread(self) -> None:
        aio_loop = self._aio_loop
        if aio_loop is None or aio_loop.is_closed():
            return

        def schedule() -> None:
            task = aio_loop.create_task(self._sync_grpc_health())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

        aio_loop.call_soon_threadsafe(schedule)

    def _on_generation_health(self, state: GenerationHealth) -> None:
        if state == GenerationHealth.FAILED:
            logger.error("A forward pass failed: gRPC health is NOT_SERVING until generation succeeds again")
        self._resync_from_loop_thread()

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc
        self._resync_from_loop_thread()

    # ---- shutdown -----------------------------------------------------------------------------------

    async def stop(self, grace: float | None = None) -> None:
        """Stop admitting and report NOT_SERVING; close HTTP; let in-flight calls finish within `grace`
        seconds (default SHUTDOWN_GRACE_SECONDS); then stop gRPC, the loop and the workers."""
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        self.drain.closed = True
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        remaining = await self.drain.close(grace)
        if remaining:
            logger.warning(f"Shutdown grace of {grace:g} s is over: cancelling {remaining} call(s) in flight")
        if self.grpc_server is not None:
            await self.grpc_server.stop(FINAL_GRPC_GRACE_SECONDS if grace else 0)
        await asyncio.to_thread(self.engine_loop.stop)
        self._executor.shutdown(wait=False)
        self.tracing.shutdown()
