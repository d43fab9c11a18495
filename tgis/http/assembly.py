"""The HTTP server on PORT with everything on it: health, metrics, and the OpenAI and TGI routes over the
service core (the same permits, queue and engine loop as gRPC)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from tgis.config import Settings
from tgis.engine_loop.core import LoopLoad
from tgis.errors import StartupError
from tgis.http.api import HttpApi
from tgis.http.frontend import Frontend
from tgis.http.gateway import GatewayLoadCollector
from tgis.http.openai import OpenAIRoutes
from tgis.http.server import HttpServer
from tgis.http.tgi import TgiRoutes
from tgis.metrics import Metrics
from tgis.service.context import ServiceContext
from tgis.service.health import HealthChecker
from tgis.tls import TlsFiles, http_ssl_context


def build_http_server(
    settings: Settings,
    context: ServiceContext,
    health: HealthChecker,
    metrics: Metrics,
    load: Callable[[], LoopLoad],
    tls: TlsFiles | None,
) -> HttpServer:
    served = settings.served_model_name or settings.model_name or "demo"
    frontend = Frontend(context, served)
    # Every running request may use its own adapter: the batch size bounds the distinct ones.
    metrics.registry.register(GatewayLoadCollector(load, served, settings.max_batch_size))
    api = HttpApi(frontend, api_key=settings.api_key, request_timeout=settings.http_request_timeout)
    openai = OpenAIRoutes(frontend, api)
    tgi = TgiRoutes(frontend, api, (settings.watermark_gamma, settings.watermark_delta))

    def routes(app: web.Application) -> None:
        openai.add_to(app)
        tgi.add_to(app)

    ssl_context = None
    if settings.http_tls:
        if tls is None:
            raise StartupError("HTTP_TLS needs TLS_CERT_PATH and TLS_KEY_PATH")
        ssl_context = http_ssl_context(settings, tls)
    return HttpServer(
        health,
        metrics,
        api=api,
        routes=routes,
        ssl_context=ssl_context,
        max_body_bytes=settings.http_max_body_bytes,
    )
