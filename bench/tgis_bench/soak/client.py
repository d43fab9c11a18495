"""The soak's client: one gRPC channel and one HTTP session, each arrival sent as its kind and timed."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
import grpc

from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis_bench.soak import grpc as soak_grpc
from tgis_bench.soak import http as soak_http
from tgis_bench.soak.grpc import Answer, greedy
from tgis_bench.soak.http import (
    OPENAI_STREAM,
    TGI_STREAM,
    openai_body,
    openai_tokens,
    tgi_body,
    tgi_tokens,
)
from tgis_bench.soak.mix import Arrival

# The guided requests' constraints: small enough for any vocabulary, all finishing well within 64 tokens.
REGEX = r"[a-z]+( [a-z]+){1,5}\."
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue", "yellow"]


@dataclass(frozen=True)
class SoakTarget:
    """Where and what the soak sends: the server's two ports, its model name and adapters, the limits."""

    grpc: str  # host:port
    http: str  # base URL, e.g. http://127.0.0.1:3000
    model: str  # the base model's name on the OpenAI routes
    lora: str | None = None  # adapter ids in the server's adapter store
    prefix: str | None = None
    time_limit_ms: int = 500  # grpc_time_limit's stopping.time_limit_millis
    deadline_ms: int = 800  # grpc_deadline's client-side deadline
    timeout: float = 300.0  # any other request: longer than this is a hang, recorded as a failure


@dataclass(frozen=True)
class SoakRecord:
    """One request: its kind, when it was sent and ended (seconds since the soak began), how it ended."""

    kind: str
    start: float
    end: float
    ttft: float | None
    code: str
    tokens: int

    @property
    def latency(self) -> float:
        return self.end - self.start


Sender = Callable[["SoakClient", Arrival], Awaitable[Answer]]


class SoakClient:
    """Sends arrivals; a gRPC status, an HTTP status or a client-side error becomes the record's code."""

    def __init__(self, target: SoakTarget, prompts: Sequence[str], zero: float) -> None:
        if not prompts:
            raise ValueError("the soak needs at least one prompt")
        self.target = target
        self.prompts = prompts
        self.zero = zero  # time.perf_counter() at the start of the soak

    async def __aenter__(self) -> SoakClient:
        self.channel = grpc.aio.insecure_channel(self.target.grpc)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        connector = aiohttp.TCPConnector(limit=0)  # an open loop must not queue behind a pool limit
        timeout = aiohttp.ClientTimeout(total=self.target.timeout)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.session.close()
        await self.channel.close()

    async def send(self, arrival: Arrival) -> SoakRecord:
        started = time.perf_counter()
        try:
            answer = await SENDERS[arrival.kind](self, arrival)
        except grpc.aio.AioRpcError as error:
            answer = Answer(f"grpc:{error.code().name}", 0)
        except (aiohttp.ClientError, TimeoutError) as error:
            answer = Answer(f"client:{type(error).__name__}", 0)
        except (ValueError, KeyError, TypeError) as error:  # an answer not shaped as its route's: recorded
            answer = Answer(f"client:malformed answer ({type(error).__name__})", 0)
        ended = time.perf_counter()
        return SoakRecord(
            arrival.kind, started - self.zero, ended - self.zero, answer.ttft, answer.code, answer.tokens
        )

    def prompt(self, arrival: Arrival, offset: int = 0) -> str:
        return self.prompts[(arrival.prompt + offset) % len(self.prompts)]

    def url(self, path: str) -> str:
        return self.target.http.rstrip("/") + path

    # ---- gRPC -----------------------------------------------------------------------------------------

    def unary(
        self, a: Arrival, params: pb.Parameters, *, inputs: int = 1, adapter: str | None = None
    ) -> Awaitable[Answer]:
        texts = [self.prompt(a, i) for i in range(inputs)]
        return soak_grpc.generate(self.stub, texts, params, timeout=self.target.timeout, adapter_id=adapter)

    def stream(
        self,
        a: Arrival,
        params: pb.Parameters,
        *,
        adapter: str | None = None,
        cancel_after: int | None = None,
    ) -> Awaitable[Answer]:
        return soak_grpc.generate_stream(
            self.stub,
            self.prompt(a),
            params,
            timeout=self.target.timeout,
            adapter_id=adapter,
            cancel_after=cancel_after,
        )

    def deadline(self, a: Arrival) -> Awaitable[Answer]:
        return soak_grpc.generate(
            self.stub, [self.prompt(a)], greedy(a.new_tokens), timeout=self.target.deadline_ms / 1000
        )

    # ---- HTTP -----------------------------------------------------------------------------------------

    def completion(
        self, a: Arrival, *, stream: bool = False, model: str | None = None, **extra: Any
    ) -> Awaitable[Answer]:
        exact = not extra  # guided requests end with their constraint
        body = openai_body(
            model or self.target.model,
            a.new_tokens,
            stream=stream,
            exact=exact,
            prompt=self.prompt(a),
            **extra,
        )
        return self._openai("/v1/completions", body, stream)

    def chat(self, a: Arrival, *, stream: bool = False) -> Awaitable[Answer]:
        messages = [{"role": "user", "content": self.prompt(a)}]
        body = openai_body(self.target.model, a.new_tokens, stream=stream, messages=messages)
        return self._openai("/v1/chat/completions", body, stream)

    def _openai(self, path: str, body: dict[str, Any], stream: bool) -> Awaitable[Answer]:
        if stream:
            return soak_http.post_stream(self.session, self.url(path), body, OPENAI_STREAM)
        return soak_http.post_json(self.session, self.url(path), body, openai_tokens)

    def tgi(self, a: Arrival, *, stream: bool = False, **parameters: Any) -> Awaitable[Answer]:
        body = tgi_body(self.prompt(a), a.new_tokens, **parameters)
        if stream:
            return soak_http.post_stream(self.session, self.url("/generate_stream"), body, TGI_STREAM)
        return soak_http.post_json(self.session, self.url("/generate"), body, tgi_tokens)

    def hang_up(self, a: Arrival, path: str, body: dict[str, Any]) -> Awaitable[Answer]:
        form = OPENAI_STREAM if path.startswith("/v1/") else TGI_STREAM
        return soak_http.post_stream(self.session, self.url(path), body, form, close_after=halfway(a))


def halfway(arrival: Arrival) -> int:
    """When the cancelling kinds give up: half the tokens they asked for, at least one."""
    return max(1, arrival.new_tokens // 2)


def _guided(**fields: Any) -> pb.DecodingParameters:
    return pb.DecodingParameters(**fields)


SENDERS: dict[str, Sender] = {
    "grpc_unary": lambda c, a: c.unary(a, greedy(a.new_tokens)),
    "grpc_batch": lambda c, a: c.unary(a, greedy(a.new_tokens), inputs=2 + a.index % 3),
    "grpc_stream": lambda c, a: c.stream(a, greedy(a.new_tokens)),
    "grpc_stream_cancel": lambda c, a: c.stream(a, greedy(a.new_tokens), cancel_after=halfway(a)),
    "grpc_time_limit": lambda c, a: c.unary(a, greedy(a.new_tokens, time_limit_ms=c.target.time_limit_ms)),
    "grpc_deadline": lambda c, a: c.deadline(a),
    "grpc_regex": lambda c, a: c.unary(a, greedy(a.new_tokens, exact=False, decoding=_guided(regex=REGEX))),
    "grpc_json_schema": lambda c, a: c.unary(
        a, greedy(a.new_tokens, exact=False, decoding=_guided(json_schema=json.dumps(JSON_SCHEMA)))
    ),
    "grpc_choice": lambda c, a: c.unary(
        a,
        greedy(
            a.new_tokens,
            exact=False,
            decoding=_guided(choice=pb.DecodingParameters.StringChoices(choices=CHOICES)),
        ),
    ),
    "grpc_lora": lambda c, a: c.stream(a, greedy(a.new_tokens), adapter=c.target.lora),
    "grpc_prefix": lambda c, a: c.unary(a, greedy(a.new_tokens), adapter=c.target.prefix),
    "openai_completion": lambda c, a: c.completion(a),
    "openai_completion_stream": lambda c, a: c.completion(a, stream=True),
    "openai_chat": lambda c, a: c.chat(a),
    "openai_chat_stream": lambda c, a: c.chat(a, stream=True),
    "openai_json_schema": lambda c, a: c.completion(
        a, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": JSON_SCHEMA}}
    ),
    "openai_choice": lambda c, a: c.completion(a, guided_choice=CHOICES),
    "openai_lora": lambda c, a: c.completion(a, model=c.target.lora),
    "openai_stream_cancel": lambda c, a: c.hang_up(
        a, "/v1/completions", openai_body(c.target.model, a.new_tokens, stream=True, prompt=c.prompt(a))
    ),
    "tgi_generate": lambda c, a: c.tgi(a),
    "tgi_generate_stream": lambda c, a: c.tgi(a, stream=True),
    "tgi_regex": lambda c, a: c.tgi(a, grammar={"type": "regex", "value": REGEX}),
    "tgi_prefix": lambda c, a: c.tgi(a, adapter_id=c.target.prefix),
    "tgi_stream_cancel": lambda c, a: c.hang_up(a, "/generate_stream", tgi_body(c.prompt(a), a.new_tokens)),
}
