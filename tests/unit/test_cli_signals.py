"""A SIGTERM that arrives while the server opens its ports drains it: the handler is in place first."""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import pytest

from tgis import cli
from tgis.config import Settings


def test_sigterm_while_the_ports_open_shuts_down_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    import tgis.app as app

    calls: list[str] = []

    class FakeServer:
        fatal = None

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        async def start(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # as an orchestrator might, the moment a port answers
            await asyncio.sleep(0.05)
            calls.append("started")

        async def stop(self, grace: float | None = None) -> None:
            calls.append("stopped")

    monkeypatch.setattr(app, "load_model", lambda settings, environ: "model")
    monkeypatch.setattr(app, "TgisServer", FakeServer)
    try:
        assert asyncio.run(cli._serve(Settings(model_name="demo"))) == 0
    finally:
        gc.unfreeze()  # _serve froze this test process's heap
    assert calls == ["started", "stopped"]
