"""Runs a real TgisServer in-process on its own event-loop thread, bound to free ports, for gRPC tests."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import openai

from tgis.app import TgisServer, load_model
from tgis.config import Settings
from tgis.pb import generation_pb2_grpc as pb_grpc

T = TypeVar("T")
READY_DEADLINE_SECONDS = 60.0


class ServerThread:
    """A started server plus a client stub; `stop()` drains it and joins the thread."""

    def __init__(self, model_dir: Path, **settings: Any) -> None:
        """`settings` are Settings fields, plus `ready_timeout` (seconds the server may take to start)."""
        self._ready_timeout = float(settings.pop("ready_timeout", READY_DEADLINE_SECONDS))
        # TF32 off: these servers are compared with transformers' float32 answers in the same process.
        settings.setdefault("allow_tf32", False)
        self.settings = Settings(model_name=str(model_dir), port=0, grpc_port=0, **settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        model = load_model(self.settings, {})
        self.server = self._call(self._create(model), self._ready_timeout)
        self._call(self.server.start())
        self.channel = grpc.insecure_channel(f"localhost:{self.server.grpc_port}")
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        wait_until(self.http_ok, "the server answers /health")

    async def _create(self, model) -> TgisServer:
        return TgisServer(self.settings, model)

    def _call(self, coroutine, timeout: float = READY_DEADLINE_SECONDS) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def loop(self):
        return self.server.engine_loop

    @property
    def engine(self):
        """The loaded engine (tests wrap its forward methods in place)."""
        return self.server.model.engine

    def kv_blocks(self):
        """The running batch's usage: admitted requests and, on the paged step, KV blocks by state."""
        return self.server.engine_loop.runner.usage()

    @property
    def metrics(self):
        return self.server.metrics

    def openai_client(self, api_key: str = "none") -> openai.OpenAI:
        """The `openai` client on this server's HTTP port (no retries: a test sees every answer)."""
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.server.http_port}/v1", api_key=api_key, max_retries=0
        )

    def http_get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.server.http_port}{path}", timeout=10
            ) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def http_post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """A JSON POST to the HTTP port: (status, response headers, body), error statuses included."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server.http_port}{path}",
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def http_ok(self) -> bool:
        return self.http_get("/health")[0] == 200

    def stop(self) -> None:
        self.channel.close()
        self._call(self.server.stop(grace=2.0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def metric(server: ServerThread, name: str) -> float:
    """A metric's value in the server's registry, summed over its labels."""
    return sum(s.value for m in server.metrics.registry.collect() for s in m.samples if s.name == name)


def wait_until(predicate: Callable[[], T], what: str, timeout: float = READY_DEADLINE_SECONDS) -> T:
    """Poll `predicate` until it returns something truthy, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting until {what}")
