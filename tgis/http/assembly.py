"""The HTTP listeners: health and metrics on PORT, and the OpenAI and TGI generation routes over the
service core (the same permits, queue and engine loop as gRPC) under the same guard as gRPC, where
`tgis.http.layout` puts them."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from tgis.config import Settings
from tgis.engine_loop.core import LoopLoad
from tgis.http.api import HttpApi
from tgis.http.frontend import Frontend
from tgis.http.gateway import GatewayLoadCollector
from tgis.http.layout import GenerationPlace, HttpLayout, http_layout
from tgis.http.lora_routes import LoraRoutes
from tgis.http.openai import OpenAIRoutes
from tgis.http.server import HttpServer
from tgis.http.tgi import TgiRoutes
from tgis.metrics import Metrics
from tgis.service.access import AccessGuard
from tgis.service.context import ServiceContext
from tgis.service.health import HealthChecker
from tgis.tls import TlsFiles, http_ssl_context
from tgis.types import SamplingDefaults


@dataclass
class HttpListeners:
    """PORT's server, and generation's own when it has one (None: generation is on PORT, or off)."""

    main: HttpServer
    generation: HttpServer | None
    layout: HttpLayout

    @property
    def servers(self) -> tuple[HttpServer, ...]:
        return (self.main,) if self.generation is None else (self.main, self.generation)


def build_http_listeners(
    settings: Settings,
    context: ServiceContext,
    guard: AccessGuard,
    health: HealthChecker,
    metrics: Metrics,
    load: Callable[[], LoopLoad],
    tls: TlsFiles | None,
    sampling_defaults: SamplingDefaults | None = None,
) -> HttpListeners:
    layout = http_layout(settings, tls)
    ssl_context = None if tls is None else http_ssl_context(settings, tls)
    main_ssl = ssl_context if layout.port_tls else None
    if layout.generation == GenerationPlace.OFF:
        return HttpListeners(HttpServer(health, metrics, ssl_context=main_ssl), None, layout)
    served = settings.served_model_name or settings.model_name or "demo"
    frontend = Frontend(context, served, sampling_defaults)
    # Every running request may use its own adapter: the batch size bounds the distinct ones.
    metrics.registry.register(GatewayLoadCollector(load, served, settings.max_batch_size))
    api = HttpApi(
        frontend,
        guard,
        client_certificate_required=tls is not None and tls.mutual,
        request_timeout=settings.http_request_timeout,
    )
    openai = OpenAIRoutes(frontend, api)
    tgi = TgiRoutes(frontend, api, (settings.watermark_gamma, settings.watermark_delta))

    lora = LoraRoutes(frontend, api) if settings.allow_runtime_lora_updating else None

    def routes(app: web.Application) -> None:
        openai.add_to(app)
        tgi.add_to(app)
        if lora is not None:
            lora.add_to(app)

    def generation_server(ssl_context: ssl.SSLContext | None) -> HttpServer:
        return HttpServer(
            health,
            metrics,
            api=api,
            routes=routes,
            ssl_context=ssl_context,
            max_body_bytes=settings.http_max_body_bytes,
        )

    if layout.generation == GenerationPlace.ON_PORT:
        return HttpListeners(generation_server(main_ssl), None, layout)
    return HttpListeners(
        HttpServer(health, metrics, ssl_context=main_ssl),
        generation_server(ssl_context if layout.generation_tls else None),
        layout,
    )
