"""Servers for the operations tests: in-process (TLS, tracing, engine faults) and launcher subprocesses."""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tgis.app import TgisServer, load_model
from tgis.config import Settings
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.tracing import Tracing

T = TypeVar("T")
CALL_TIMEOUT_SECONDS = 60.0


class OpsServer:
    """A TgisServer on its own event-loop thread. Unlike the integration harness it does not call
    /health at start, so the generation-health flag is still untouched when a test begins."""

    def __init__(self, model_dir: Path, *, tracing: Tracing | None = None, **settings: Any) -> None:
        # TF32 off: these servers are compared with transformers' float32 answers in the same process.
        settings.setdefault("allow_tf32", False)
        self.settings = Settings(model_name=str(model_dir), port=0, grpc_port=0, **settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ops-server", daemon=True)
        self._thread.start()
        model = load_model(self.settings, {})
        self.server = self.call(self._create(model, tracing))
        try:
            self.call(self.server.start())
        except BaseException:
            self._close_loop()
            raise
        self._channels: list[grpc.Channel] = []

    async def _create(self, model: Any, tracing: Tracing | None) -> TgisServer:
        return TgisServer(self.settings, model, tracing=tracing)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT_SECONDS) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def target(self) -> str:
        return f"localhost:{self.server.grpc_port}"

    def channel(self, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
        channel = (
            grpc.insecure_channel(self.target)
            if credentials is None
            else grpc.secure_channel(self.target, credentials)
        )
        self._channels.append(channel)
        return channel

    def stub(self, credentials: grpc.ChannelCredentials | None = None) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(self.channel(credentials))

    def grpc_health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self.channel())
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def http_get(self, path: str) -> tuple[int, bytes]:
        return http_get(self.server.http_port, path)

    def begin_stop(self, grace: float) -> Future[None]:
        """Start the server's shutdown (drain within `grace`) without waiting for it."""
        return asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop)

    def stop(self, grace: float = 2.0) -> None:
        if not self.server.drain.closed:
            self.begin_stop(grace).result(CALL_TIMEOUT_SECONDS)
        self.close()

    def close(self) -> None:
        """Release the client channels and the event-loop thread of a stopped server."""
        for channel in self._channels:
            channel.close()
        self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> OpsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class EngineFault:
    """Wraps the engine's forward passes: counts prefills, and can make both kinds fail or block."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.prefills = 0
        self.failing = False
        self.gate: threading.Event | None = None
        self.decodes = 0
        self.on_decode: Callable[[int], object] | None = None
        self.fatal: BaseException | None = None  # raised past the loop's per-request handling
        # Paged engines run one `step` (a step with prompt chunks counts as a prefill); padded
        # engines run `prefill` and `decode`.
        self._names = ("step",) if engine.spec.paged else ("prefill", "decode")
        self._originals: dict[str, Callable[..., Any]] = {name: getattr(engine, name) for name in self._names}
        for name in self._names:
            setattr(engine, name, getattr(self, name))

    def step(self, batch: Any) -> Any:
        (self._before_prefill if batch.prefill else self._before_decode)()
        return self._originals["step"](batch)

    def prefill(self, rows: Any) -> Any:
        self._before_prefill()
        return self._originals["prefill"](rows)

    def decode(self, token_ids: Any) -> Any:
        self._before_decode()
        return self._originals["decode"](token_ids)

    def _before_prefill(self) -> None:
        self.prefills += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.fatal is not None:
            raise self.fatal
        if self.failing:
            raise RuntimeError("injected device failure")

    def _before_decode(self) -> None:
        self.decodes += 1
        if self.on_decode is not None:
            self.on_decode(self.decodes)
        if self.failing:
            raise RuntimeError("injected device failure")

    def restore(self) -> None:
        for name, original in self._originals.items():
            setattr(self.engine, name, original)


def http_get(port: int, path: str, timeout: float = 90) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def generate_request(text: str, max_new_tokens: int, **params: Any) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text)],
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens), **params),
    )
