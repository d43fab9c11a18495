"""Assembles a running server: model + loop + gRPC (service, health, reflection) + HTTP (health, metrics)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engines.base import Engine, EngineConfig
from engines.registry import load_engine
from tgis.batching.scheduler import Scheduler
from tgis.config import Settings, effective_limits, hub_cache_dir
from tgis.hub import resolve_model_path
from tgis.loop import EngineLoop
from tgis.metrics import Metrics
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.server.permits import Permits
from tgis.server.servicer import GenerationServicer, ServiceContext
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import ModelKind

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


@dataclass(frozen=True)
class LoadedModel:
    path: Path
    engine: Engine
    tokenizer: Tokenizer


def load_model(settings: Settings, environ: Mapping[str, str]) -> LoadedModel:
    """Resolve the model offline (or build the demo model), then load engine and tokenizer."""
    if settings.model_name:
        path = resolve_model_path(
            settings.model_name, revision=settings.revision, cache_dir=hub_cache_dir(environ)
        )
    else:
        from tgis.demo_model import ensure_demo_model

        path = ensure_demo_model()
        logger.info(f"MODEL_NAME is not set: serving the built-in demo model from {path}")
    engine = load_engine(
        settings.deployment_framework,
        EngineConfig(
            model_path=path,
            dtype=settings.dtype_name,
            trust_remote_code=settings.trust_remote_code,
            attn_implementation=settings.transformers_attn_impl,
        ),
    )
    tokenizer = Tokenizer.load(
        path,
        trust_remote_code=settings.trust_remote_code,
        output_special_tokens=settings.output_special_tokens,
    )
    return LoadedModel(path, engine, tokenizer)


def default_tokenization_workers(shards: int = 1) -> int:
    return min(max((os.cpu_count() or 1) - shards, 1), 8)


class TgisServer:
    """One serving process; `start` binds the ports (0 picks free ones), `stop` drains and shuts down."""

    def __init__(self, settings: Settings, model: LoadedModel) -> None:
        self.settings = settings
        self.model = model
        spec = model.engine.spec
        self.limits = effective_limits(settings, spec.model_config)
        self.metrics = Metrics(
            max_sequence_length=self.limits.max_sequence_length,
            max_new_tokens=self.limits.max_new_tokens,
            max_batch_size=settings.max_batch_size,
        )
        self.fatal: BaseException | None = None
        self.loop = EngineLoop(
            model.engine,
            model.tokenizer,
            Scheduler(settings.max_batch_size, settings.max_waiting_tokens),
            self.metrics,
            on_fatal=self._on_fatal,
        )
        self._executor = ThreadPoolExecutor(
            settings.tokenization_workers or default_tokenization_workers(), thread_name_prefix="tokenize"
        )
        self.health = health.aio.HealthServicer()
        self.grpc_server: grpc.aio.Server | None = None
        self._http_runner: web.AppRunner | None = None
        self.grpc_port = 0
        self.http_port = 0
        self._stopped = asyncio.Event()

    def _context(self) -> ServiceContext:
        spec = self.model.engine.spec
        return ServiceContext(
            loop=self.loop,
            tokenizer=self.model.tokenizer,
            metrics=self.metrics,
            limits=self.limits,
            model_kind=ModelKind.ENCODER_DECODER if spec.is_encoder_decoder else ModelKind.DECODER_ONLY,
            permits=Permits(self.settings.max_concurrent_requests),
            tokenization_executor=self._executor,
            default_include_stop_seqs=self.settings.default_include_stop_seqs,
            prefix_store_configured=self.settings.prefix_store_path is not None,
        )

    async def start(self) -> None:
        self.loop.start()
        server = grpc.aio.server()
        pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(self._context()), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.grpc_port = server.add_insecure_port(f"[::]:{self.settings.grpc_port}")
        await server.start()
        self.grpc_server = server
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info(f"gRPC server listening on port {self.grpc_port}")
        await self._start_http()
        logger.info(f"HTTP server (health, metrics) listening on port {self.http_port}")

    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._http_health)
        app.router.add_get("/metrics", self._http_metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host="0.0.0.0", port=self.settings.port)
        await site.start()
        self._http_runner = runner
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.http_port = server.sockets[0].getsockname()[1]

    async def _http_health(self, request: web.Request) -> web.Response:
        if self.loop.alive and self.fatal is None:
            return web.Response(status=200)
        return web.json_response({"error": "unhealthy"}, status=503)

    async def _http_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc

    async def stop(self, grace: float = 5.0) -> None:
        """Stop admitting, report NOT_SERVING, let in-flight calls finish within `grace`, then shut down."""
        await self.health.enter_graceful_shutdown()
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
        await asyncio.to_thread(self.loop.stop)
        self._executor.shutdown(wait=False)
        self._stopped.set()
