"""Server-sent events: `data: <json>` frames on a chunked aiohttp response, `data: [DONE]` at the end."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from aiohttp import web


class SseWriter:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )

    async def open(self) -> None:
        await self.response.prepare(self.request)
        self.request[SSE_KEY] = self

    async def fail(self, error: dict[str, Any]) -> web.StreamResponse:
        """End an open stream with an error event (the status line has already gone out)."""
        with contextlib.suppress(ConnectionError):
            await self.send(error)
            await self.response.write_eof()
        return self.response

    async def send(self, data: Any) -> None:
        """One event; raises ConnectionResetError once the client has gone (the job is then cancelled)."""
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data:{payload}\n\n".encode())

    async def done(self, marker: bool = True) -> None:
        if marker:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()


SSE_KEY: web.RequestKey[SseWriter] = web.RequestKey("tgis_sse", SseWriter)
