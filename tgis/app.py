"""The composition root: one serving process built from the loaded model, the engine loop, the service
core and the two front doors (gRPC and HTTP), which know nothing of each other."""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from tgis import __version__
from tgis.config import Settings, effective_limits
from tgis.engine_loop.core import EngineLoop
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.outputs import OutputProcessor
from tgis.guided import GrammarCache
from tgis.http.assembly import build_http_listeners
from tgis.http.layout import GenerationPlace
from tgis.http.server import HttpServer
from tgis.metrics import Metrics
from tgis.model_choice import DEMO_MODEL_NAME
from tgis.rpc.server import GrpcServer
from tgis.service.access import AccessGuard
from tgis.service.context import ServiceContext
from tgis.service.health import LIVENESS_TEXT, DrainGate, HealthChecker
from tgis.service.permits import Permits
from tgis.startup.model import LoadedModel, adapter_store, load_model
from tgis.startup.runners import build_runner
from tgis.tls import TlsFiles, load_tls
from tgis.tracing import Tracing, create_tracing
from tgis.types import GenerationHealth

__all__ = ["LoadedModel", "TgisServer", "load_model"]

logger = logging.getLogger(__name__)

# After the drain, calls still open (e.g. health Watch streams) get this long before they are cut.
FINAL_GRPC_GRACE_SECONDS = 1.0


def default_tokenization_workers(shards: int = 1) -> int:
    return min(max((os.cpu_count() or 1) - shards, 1), 8)


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
            model_name=settings.served_model_name or settings.model_name or DEMO_MODEL_NAME,
        )
        self.metrics.set_build_info(
            version=__version__,
            engine=spec.engine_name,
            dtype=str(spec.dtype).removeprefix("torch."),
            model=settings.model_name or DEMO_MODEL_NAME,
        )
        self.fatal: BaseException | None = None
        self.adapters = adapter_store(settings, spec, self.limits, self.metrics)
        self.liveness_ids = model.tokenizer.encode(LIVENESS_TEXT).ids
        self.engine_loop = self._engine_loop()
        self._executor = ThreadPoolExecutor(
            settings.tokenization_workers or default_tokenization_workers(shards),
            thread_name_prefix="tokenize",
        )
        self.drain = DrainGate()
        self.guard = AccessGuard(self.metrics, api_key=settings.api_key)
        self.grpc = GrpcServer(self.tls, self.guard)
        self.http: HttpServer | None = None  # PORT: health, metrics (and generation when it shares PORT)
        self.http_generation: HttpServer | None = None  # generation's own port, when it has one
        self.health_checker: HealthChecker | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.http_generation_port: int | None = None  # where HTTP generation is served; None: nowhere
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task[None]] = set()

    def _engine_loop(self) -> EngineLoop:
        """The engine loop over the runner the engine calls for (paged or padded)."""
        metrics = LoopMetrics(self.metrics)
        outputs = OutputProcessor(self.model.tokenizer, self.model.engine.spec, metrics)
        runner = build_runner(
            self.settings,
            self.model,
            self.limits,
            metrics,
            outputs.eos_token_ids,
            probe_ids=self.liveness_ids,
            with_prefixes=self.adapters is not None,
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
            add_special_tokens=self.settings.add_special_tokens,
            prompt_logprobs=not self.settings.disable_prompt_logprobs,
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
        health = HealthChecker(
            self.engine_loop,
            self.liveness_ids,
            self.model.engine.spec.device,
            failed=lambda: self.fatal is not None,
        )
        self.health_checker = health
        self.engine_loop.start()
        try:
            context = self._context()
            self.grpc_port = await self.grpc.start(context, self.settings.grpc_port, serving=self.serving)
            listeners = build_http_listeners(
                self.settings,
                context,
                self.guard,
                health,
                self.metrics,
                self.engine_loop.load,
                self.tls,
                self.model.sampling_defaults,
            )
            self.http, self.http_generation = listeners.main, listeners.generation
            self.http_port = await self.http.start(self.settings.port)
            place = listeners.layout.generation
            if self.http_generation is not None:
                self.http_generation_port = await self.http_generation.start(
                    listeners.layout.generation_port or 0
                )
            elif place == GenerationPlace.ON_PORT:
                self.http_generation_port = self.http_port
        except BaseException:
            await self.stop(grace=0)
            raise
        self._log_http_listeners()

    def _log_http_listeners(self) -> None:
        def security(server: HttpServer) -> str:
            if server.ssl_context is None:
                return "plaintext"
            return "mutual TLS" if self.tls is not None and self.tls.mutual else "TLS"

        assert self.http is not None
        generation = self.http.api is not None
        what = "health, metrics, OpenAI, TGI" if generation else "health, metrics"
        logger.info(f"HTTP server ({what}) listening on port {self.http_port} ({security(self.http)})")
        if self.http_generation is not None:
            logger.info(
                f"HTTP generation (OpenAI, TGI; health, metrics) listening on port "
                f"{self.http_generation_port} ({security(self.http_generation)})"
            )
        elif not generation:
            logger.info("HTTP generation routes are off (HTTP_GENERATION_ROUTES=false)")

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

    def _resync_from_loop_thread(self) -> None:
        aio_loop = self._aio_loop
        if aio_loop is None or aio_loop.is_closed():
            return

        def schedule() -> None:
            task = aio_loop.create_task(self.grpc.set_serving(self.serving))
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
        await self.grpc.enter_graceful_shutdown()
        for http in (self.http, self.http_generation):
            if http is not None:
                await http.stop()
        remaining = await self.drain.close(grace)
        if remaining:
            logger.warning(f"Shutdown grace of {grace:g} s is over: cancelling {remaining} call(s) in flight")
        await self.grpc.stop(FINAL_GRPC_GRACE_SECONDS if grace else 0)
        await asyncio.to_thread(self.engine_loop.stop)
        self._executor.shutdown(wait=False)
        self.tracing.shutdown()
