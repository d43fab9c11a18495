"""The soak's HTTP calls: OpenAI completions and chat, TGI /generate and /generate_stream, JSON or SSE."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from tgis_bench.peers.base import parse_event
from tgis_bench.soak.grpc import Answer

# TGI's in-stream error types back to the status a JSON answer would have had (tgis.http.errors).
TGI_ERROR_STATUS = {"validation": 400, "authentication": 401, "overloaded": 429, "unavailable": 503}


def openai_body(
    model: str, new_tokens: int, *, stream: bool, exact: bool = True, **extra: Any
) -> dict[str, Any]:
    """Greedy; `exact` asks for exactly `new_tokens` (vLLM's min_tokens); `extra` adds prompt or
    messages and any guided field."""
    body: dict[str, Any] = {"model": model, "max_tokens": new_tokens, "temperature": 0.0, **extra}
    if exact:
        body["min_tokens"] = new_tokens
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def tgi_body(prompt: str, new_tokens: int, **parameters: Any) -> dict[str, Any]:
    """Greedy (TGI's default); `details` so the answer counts its tokens."""
    return {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "details": True, **parameters}}


def in_stream_status(event: dict[str, Any]) -> int:
    """The status of an error sent inside an open stream: OpenAI's `code`, or TGI's error type."""
    error = event.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        return code if isinstance(code, int) else 500
    return TGI_ERROR_STATUS.get(str(event.get("error_type")), 500)


def openai_tokens(answer: dict[str, Any]) -> int:
    usage = answer.get("usage") or {}
    return int(usage.get("completion_tokens") or 0)


def tgi_tokens(answer: dict[str, Any]) -> int:
    details = answer.get("details") or {}
    return int(details.get("generated_tokens") or 0)


@dataclass(frozen=True)
class StreamFormat:
    """How a route's SSE events carry tokens: whether an event brought one, and the final count if told."""

    carries_token: Callable[[dict[str, Any]], bool]
    total: Callable[[dict[str, Any]], int]  # 0 when the event does not say


def openai_text(event: dict[str, Any]) -> bool:
    """Whether a chunk carries generated text: a completion's `text` or a chat `delta.content` (a chat
    stream opens with a chunk naming only the role, which is no token)."""
    choices = event.get("choices") or []
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


OPENAI_STREAM = StreamFormat(openai_text, openai_tokens)
TGI_STREAM = StreamFormat(lambda event: "token" in event, tgi_tokens)


async def post_json(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], count: Callable[[dict[str, Any]], int]
) -> Answer:
    async with session.post(url, json=body) as response:
        if response.status != 200:
            await response.read()
            return Answer(f"http:{response.status}", 0)
        return Answer("http:200", count(await response.json()))


async def post_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    form: StreamFormat,
    *,
    close_after: int | None = None,
) -> Answer:
    """Read the SSE answer to its end, or hang up once `close_after` token events came."""
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        if response.status != 200:
            await response.read()
            return Answer(f"http:{response.status}", 0)
        events, total, first = 0, 0, None
        async for line in response.content:
            event = parse_event(line)
            if event is None:
                continue
            if "error" in event:
                return Answer(f"http:{in_stream_status(event)}:in-stream", max(events, total), first)
            if form.carries_token(event):
                first = time.perf_counter() - started if first is None else first
                events += 1
            total = form.total(event) or total
            if close_after is not None and events >= close_after:
                response.close()
                return Answer("http:closed", events, first)
        return Answer("http:200", total or events, first)
