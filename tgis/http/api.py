"""What every HTTP inference route shares: the access guard (API key, client certificate), body parsing,
drain, cancellation, errors.

`prepare` hands a request's prompts to the service core's one entry point (`ServiceContext.start`, as
gRPC does) and returns a Job holding what started; the middleware closes the Job when the handler
returns or fails (a client that left cancels its inputs in the loop, freeing their slots, and the
permits are released) and turns every failure into the API's error object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

from tgis.errors import TgisError, ValidationError
from tgis.guided import Constraint
from tgis.http.errors import HttpError, error_body, error_response, parse_body, status_of
from tgis.http.frontend import Frontend
from tgis.http.sse import SSE_KEY, SseWriter
from tgis.service.access import AccessGuard, Door, Refusal
from tgis.service.calls import RequestCall
from tgis.service.context import Prompt
from tgis.service.events import Outcome, Submitted
from tgis.service.started import Started
from tgis.types import GenerationParams, InputTokensEvent, TokenEvent

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
CALL_KEY: web.RequestKey[RequestCall] = web.RequestKey("tgis_call", RequestCall)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Job:
    """One HTTP request's inputs in the loop, with the permits they hold until `close`."""

    def __init__(
        self, frontend: Frontend, kind: str, started: Started, call: RequestCall, arrival: float
    ) -> None:
        self.frontend = frontend
        self.kind = kind
        self.started = started
        self.submitted = started.submitted
        self.call = call
        self.arrival = arrival
        self._outcomes = [Outcome(s.task.input) for s in started.submitted]
        self.finished = False

    async def collect(self) -> list[Outcome]:
        outcomes = await asyncio.gather(*(s.outcome() for s in self.submitted))
        self._outcomes = list(outcomes)
        self._finish()
        return self._outcomes

    async def stream(self) -> AsyncIterator[tuple[int, InputTokensEvent | TokenEvent]]:
        """Every input's events as they come, tagged with the input's index."""
        merged: asyncio.Queue[tuple[int, InputTokensEvent | TokenEvent | BaseException | None]] = (
            asyncio.Queue()
        )

        async def pump(index: int, submitted: Submitted) -> None:
            try:
                async for event in submitted.stream():
                    merged.put_nowait((index, event))
            except BaseException as exc:
                merged.put_nowait((index, exc))
                return
            merged.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.submitted)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await merged.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self._outcomes[index].add(item)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
        self._finish()

    def outcomes(self) -> list[Outcome]:
        return self._outcomes

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        finals = [o.final for o in self._outcomes]
        self.frontend.ctx.record_success(self.kind, finals, self.arrival)
        self.call.finish([s.task for s in self.submitted], finals)

    def close(self) -> None:
        self.started.close()


JOB_KEY: web.RequestKey[Job] = web.RequestKey("tgis_job", Job)


class HttpApi:
    """Shared by the OpenAI and TGI routes; `middleware` wraps every route of the app."""

    def __init__(
        self,
        frontend: Frontend,
        guard: AccessGuard,
        *,
        client_certificate_required: bool = False,
        request_timeout: float | None = None,
    ) -> None:
        self.frontend = frontend
        self.guard = guard
        self.client_certificate_required = client_certificate_required
        self.request_timeout = request_timeout

    async def parse(self, request: web.Request, model: type[M]) -> M:
        if request.content_type not in ("application/json", "application/octet-stream", "text/plain", ""):
            raise ValidationError(f"Content-Type must be application/json, not {request.content_type}")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise HttpError(413, f"request body is larger than {request.app._client_max_size} bytes") from exc
        return parse_body(body, model)

    async def prepare(
        self,
        request: web.Request,
        kind: str,
        prompts: Sequence[Prompt],
        params: GenerationParams,
        model: str | None,
        *,
        streamed: bool,
        special_tokens: bool | None = None,
        constraint: Constraint | None = None,
        user: str | None = None,
    ) -> Job:
        """The request through the service core's one entry point (TGIS's rules, order and messages);
        the Job is closed by the middleware.

        `streamed`: the handler reads the Job with `stream()`; otherwise with `collect()`, and the
        inputs' events arrive once each is done."""
        frontend = self.frontend
        arrival = time.monotonic()
        metrics = frontend.ctx.metrics
        metrics.request_count.labels(kind=kind).inc()
        metrics.request_input_count.inc(len(prompts))
        call = self._call(request, kind, prompts, arrival)
        call.record.user = user
        request[CALL_KEY] = call
        started = await frontend.ctx.start(
            call,
            prompts,
            params,
            arrival=arrival,
            streamed=streamed,
            adapter_id=frontend.adapter_id_for_model(model),
            constraint=constraint,
            special_tokens=special_tokens,
        )
        job = Job(frontend, kind, started, call, arrival)
        request[JOB_KEY] = job
        return job

    def _call(
        self, request: web.Request, kind: str, prompts: Sequence[Prompt], arrival: float
    ) -> RequestCall:
        headers = [(k.lower(), v) for k, v in request.headers.items()]
        tracing = self.frontend.ctx.tracing
        span_name = f"{request.method} {request.path}"
        return RequestCall.open(tracing, headers, prompts, arrival, method=kind, span_name=span_name)

    def refusal(self, request: web.Request) -> Refusal | None:
        """Why the guard refuses this request (None: it may go on). Over mutual TLS a client that
        presented no certificate got through the handshake (see tgis.tls.http_ssl_context), not here."""
        if self.client_certificate_required:
            transport = request.transport
            if transport is None or not transport.get_extra_info("peercert"):
                return Refusal.CLIENT_CERTIFICATE
        return self.guard.check_api_key(request.headers.get("Authorization"))

    async def echo_request_ids(self, request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: a generation request's ids go back in its response headers (streams
        too): x-request-id and x-correlation-id."""
        call: RequestCall | None = request.get(CALL_KEY)
        if call is not None:
            response.headers.update(call.echoed())

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        openai = request.path.startswith("/v1/")
        if request.path in ("/health", "/metrics"):
            return await handler(request)
        refusal = self.refusal(request)
        if refusal is not None:
            target = f"{request.method} {request.path}"
            self.guard.refused(Door.HTTP, refusal, peer=request.remote or "unknown", target=target)
            return error_response(401, refusal.message, openai=openai)
        try:
            async with self.frontend.ctx.drain.admit(), asyncio.timeout(self.request_timeout or None):
                return await handler(request)
        except TimeoutError:
            self._failed(request, "request timed out")
            return await self._error(
                request, 408, f"request timed out after {self.request_timeout:g}s", openai
            )
        except HttpError as exc:
            self._failed(request, exc.message)
            return await self._error(request, exc.status, exc.message, openai)
        except TgisError as exc:
            status = status_of(exc)
            if status == 400:
                self.frontend.ctx.metrics.request_failure.labels(err="validation").inc()
            self._failed(request, exc.message)
            return await self._error(request, status, exc.message, openai)
        except ConnectionResetError:  # the client left while its answer was being written
            self._failed(request, "cancelled by the client")
            return self._abandoned(request)
        except asyncio.CancelledError:
            self._failed(request, "cancelled by the client")
            raise
        except web.HTTPException:
            raise
        except Exception as exc:
            logger.exception(f"{request.method} {request.path} failed")
            self.frontend.ctx.metrics.request_failure.labels(err="unknown").inc()
            self._failed(request, f"{type(exc).__name__}: {exc}")
            return await self._error(request, 500, f"{type(exc).__name__}: {exc}", openai)
        finally:
            job: Job | None = request.get(JOB_KEY)
            if job is not None:
                job.close()

    def _failed(self, request: web.Request, error: str) -> None:
        call: RequestCall | None = request.get(CALL_KEY)
        job: Job | None = request.get(JOB_KEY)
        if call is not None and not (job is not None and job.finished):
            call.fail(error)

    @staticmethod
    def _abandoned(request: web.Request) -> web.StreamResponse:
        """What a handler whose client left returns: nobody reads it, but raising instead would have
        aiohttp log the disconnect as a server error and try to send a 500 (499: nginx's "client
        closed request")."""
        stream: SseWriter | None = request.get(SSE_KEY)
        return stream.response if stream is not None else web.Response(status=499)

    async def _error(
        self, request: web.Request, status: int, message: str, openai: bool
    ) -> web.StreamResponse:
        stream: SseWriter | None = request.get(SSE_KEY)
        if stream is not None:  # the stream has started: the error goes in-band, as OpenAI and TGI send it
            return await stream.fail(error_body(status, message, openai=openai))
        return error_response(status, message, openai=openai)
