"""The HTTP server on PORT: `GET /health`, `GET /metrics` (SPEC §11), and the inference APIs when given.

Served over TLS with the gRPC side's certificates when TLS is configured."""

from __future__ import annotations

import asyncio
import errno
import json
import ssl
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from tgis.config import StartupError
from tgis.http.api import HttpApi
from tgis.metrics import Metrics
from tgis.service.health import HealthChecker, Verdict

# On shutdown an in-flight probe is not worth waiting for: the pod is going away.
SHUTDOWN_TIMEOUT_SECONDS = 2.0


class HttpServer:
    def __init__(
        self,
        health: HealthChecker,
        metrics: Metrics,
        *,
        api: HttpApi | None = None,
        routes: Callable[[web.Application], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_body_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self.health = health
        self.metrics = metrics
        self.api = api
        self.routes = routes
        self.ssl_context = ssl_context
        self.max_body_bytes = max_body_bytes
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, port: int) -> int:
        """Bind `port` (0 picks a free one) and return the bound port."""
        middlewares = [self.api.middleware] if self.api is not None else []
        app = web.Application(middlewares=middlewares, client_max_size=self.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        if self.routes is not None:
            self.routes(app)
        if self.api is not None:
            app.on_response_prepare.append(self.api.echo_request_ids)
        # A client that leaves before its unary answer (a beam search cannot stream) cancels its handler,
        # which cancels its requests in the loop: their slots and KV blocks free at once.
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_SECONDS, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, host="0.0.0.0", port=port, ssl_context=self.ssl_context)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"HTTP port {port} is already in use") from exc
            raise StartupError(f"could not listen on HTTP port {port}: {exc.strerror}") from exc
        self._runner = runner
        server = site._server
        assert isinstance(server, asyncio.base_events.Server)
        self.port = server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        verdict = await self.health.check()
        if verdict == Verdict.HEALTHY:
            return web.Response(status=200)
        # Exactly TGIS's body: no space after the colon.
        body = json.dumps({"error": verdict.value}, separators=(",", ":"))
        return web.Response(status=503, text=body, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
