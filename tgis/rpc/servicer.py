"""The fmaas GenerationService on grpc.aio: thin handlers (convert → validate → submit → convert)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from tgis.engine_loop.tasks import Adapter
from tgis.errors import Msg, TgisError, ValidationError
from tgis.metrics import Metrics
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.rpc import responses
from tgis.rpc.params import constraint_of, effective_params
from tgis.service.calls import RequestCall
from tgis.service.context import ServiceContext
from tgis.service.events import Outcome, Submitted
from tgis.service.started import Started
from tgis.types import InputTokensEvent, ModelKind, StopReason

logger = logging.getLogger(__name__)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedGenerationResponse:
        arrival = time.monotonic()
        count = len(request.requests)
        self.ctx.metrics.request_count.labels(kind="single" if count == 1 else "batch").inc()
        if count == 0:
            return pb.BatchedGenerationResponse()
        self.ctx.metrics.request_input_count.inc(count)
        texts = [r.text for r in request.requests]
        call = self._call("Generate", context, texts, arrival)
        await context.send_initial_metadata(call.echoed())  # the ids before the answer, too
        async with self._errors_as_status(context, call), self.ctx.drain.admit():
            started = await self._start(request, call, texts, arrival, streamed=False)
            async with started:
                answers = [await self._collect(s) for s in started.submitted]
            self.ctx.record_success("single" if count == 1 else "batch", answers, arrival)
            call.finish([s.task for s in started.submitted], answers)
            return pb.BatchedGenerationResponse(responses=answers)

    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        arrival = time.monotonic()
        self.ctx.metrics.request_count.labels(kind="stream").inc()
        call = self._call("GenerateStream", context, [request.request.text], arrival)
        await context.send_initial_metadata(call.echoed())  # a reader knows them before message one
        async with self._errors_as_status(context, call), self.ctx.drain.admit():
            if not request.HasField("request"):
                raise ValidationError(Msg.MISSING_REQUEST)
            self.ctx.metrics.request_input_count.inc()
            started = await self._start(request, call, [request.request.text], arrival, streamed=True)
            async with started:
                (submitted,) = started.submitted
                validated = submitted.task.input
                input_text = validated.text if validated.params.response.input_text else None
                yield responses.stream_first_message(
                    input_token_count=len(validated.input_ids), input_text=input_text, seed=validated.seed
                )
                async for message in self._stream_messages(submitted, arrival, call):
                    yield message

    async def Tokenize(
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        started = time.monotonic()
        metrics = self.ctx.metrics
        metrics.tokenize_request_count.inc()
        metrics.tokenize_request_input_count.inc(len(request.requests))
        with_offsets = request.return_offsets
        async with self._errors_as_status(context, None), self.ctx.drain.admit():
            # The adapter does not change tokenization, but its id is checked as Generate checks it.
            await self._adapter(request.adapter_id or request.prefix_id)
            try:
                encodings = await asyncio.gather(
                    *(self.ctx.encode(r.text, with_offsets=with_offsets) for r in request.requests)
                )
            except Exception as exc:
                await context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        answers = [
            responses.tokenize_response(
                e.ids,
                self.ctx.tokenizer.token_strings(e.ids) if request.return_tokens else None,
                e.byte_offsets if with_offsets else None,
                request.truncate_input_tokens,
            )
            for e in encodings
        ]
        metrics.tokenize_request_tokens.observe(sum(a.token_count for a in answers))
        metrics.tokenize_request_duration.observe(time.monotonic() - started)
        return pb.BatchedTokenizeResponse(responses=answers)

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(
            model_kind=self.ctx.model_kind.name,
            max_sequence_length=self.ctx.limits.max_sequence_length,
            max_new_tokens=self.ctx.limits.max_new_tokens,
        )

    # ---- steps shared by Generate and GenerateStream ------------------------------------------------

    async def _start(
        self,
        request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest,
        call: RequestCall,
        texts: Sequence[str],
        arrival: float,
        *,
        streamed: bool,
    ) -> Started:
        """The request in the service core's terms, through its one entry point."""
        message = request.params if request.HasField("params") else None
        return await self.ctx.start(
            call,
            texts,
            effective_params(message, default_include_stop_seqs=self.ctx.default_include_stop_seqs),
            arrival=arrival,
            streamed=streamed,
            adapter_id=request.adapter_id or request.prefix_id or None,
            constraint=constraint_of(message),
        )

    async def _adapter(self, adapter_id: str) -> Adapter | None:
        """SPEC §3.1 #13: the request's prefix or LoRA adapter (`adapter_id` wins over `prefix_id`)."""
        return await self.ctx.adapter(adapter_id) if adapter_id else None

    async def _collect(self, submitted: Submitted) -> pb.GenerationResponse:
        outcome = await submitted.outcome()
        validated = outcome.validated
        return responses.unary_response(
            input_token_count=len(validated.input_ids),
            events=outcome.events,
            input_tokens=outcome.input_tokens,
            text_prefix=self._input_text(outcome),
            seed=validated.seed,
        )

    def _input_text(self, outcome: Outcome) -> str:
        """The input text a unary answer starts with, when asked for (not when the request never ran)."""
        final = outcome.final
        queued_out = final.stop_reason == StopReason.TIME_LIMIT and final.generated_token_count == 0
        if not outcome.validated.params.response.input_text or queued_out:
            return ""
        separator = "\n\n" if self.ctx.model_kind == ModelKind.ENCODER_DECODER else ""
        return outcome.validated.text + separator

    async def _stream_messages(
        self, submitted: Submitted, arrival: float, call: RequestCall
    ) -> AsyncIterator[pb.GenerationResponse]:
        seed = submitted.task.input.seed
        async for event in submitted.stream():
            if isinstance(event, InputTokensEvent):
                yield responses.stream_input_tokens_message(event.tokens)
                continue
            yield responses.stream_token_message(event, seed=seed)
            if event.finished:
                self.ctx.record_success("stream", [event], arrival)
                call.finish([submitted.task], [event])

    # ---- cross-cutting ------------------------------------------------------------------------------

    def _errors_as_status(self, context: grpc.aio.ServicerContext, call: RequestCall | None) -> _StatusMapper:
        return _StatusMapper(context, self.ctx.metrics, call)

    def _call(
        self, method: str, context: grpc.aio.ServicerContext, texts: Sequence[str], arrival: float
    ) -> RequestCall:
        metadata = [(m.key, str(m.value)) for m in context.invocation_metadata() or ()]
        call = RequestCall.open(self.ctx.tracing, metadata, texts, arrival, method=method)
        context.set_trailing_metadata(call.echoed())
        return call


class _StatusMapper:
    """Turns TgisError into the gRPC status it names: the one place where codes are attached."""

    def __init__(self, context: grpc.aio.ServicerContext, metrics: Metrics, call: RequestCall | None) -> None:
        self.context = context
        self.metrics = metrics
        self.call = call

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type, exc, tb) -> None:
        # Returning None lets every other exception propagate; abort() raises the mapped status.
        if exc is None or isinstance(exc, grpc.aio.AbortError):
            return
        if not isinstance(exc, TgisError):
            if isinstance(exc, asyncio.CancelledError):
                self._failed("cancelled by the client")
            elif isinstance(exc, Exception):
                self.metrics.request_failure.labels(err="unknown").inc()
                self._failed(f"{type(exc).__name__}: {exc}")
            return
        if isinstance(exc, ValidationError):
            self.metrics.request_failure.labels(err="validation").inc()
        self._failed(exc.message)
        await self.context.abort(grpc.StatusCode[exc.code.value], exc.message)

    def _failed(self, error: str) -> None:
        if self.call is not None:
            self.call.fail(error)
