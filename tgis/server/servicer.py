"""The fmaas GenerationService on grpc.aio: thin handlers (convert → validate → submit → convert)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc

from engines.base import EngineSpec, LoraAdapter, PrefixEmbeddings
from tgis.adapters.store import AdapterLoadError, AdapterStore
from tgis.api import responses
from tgis.api.params import effective_params
from tgis.api.validation import Adapter, ValidatedInput, validate_input, validate_params
from tgis.config import ServingLimits
from tgis.engine_loop.core import EngineLoop
from tgis.engine_loop.tasks import GenerationTask
from tgis.errors import GenerationError, Msg, OverloadedError, TgisError, ValidationError
from tgis.guided import Constraint, GrammarCache, constraint_of
from tgis.logs import REQUEST_ID, InputOutcome, RequestRecord
from tgis.metrics import Metrics
from tgis.openmp import run_torch_work
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis.server.delivery import EventDelivery
from tgis.server.health import DrainGate
from tgis.server.permits import Permits
from tgis.tokenization.tokenizer import Encoding, Tokenizer
from tgis.tracing import RequestSpan, Tracing
from tgis.types import (
    FailureEvent,
    GenerationEvent,
    GenerationParams,
    InputTokensEvent,
    ModelKind,
    StopReason,
    TokenEvent,
    TokenInfo,
)

logger = logging.getLogger(__name__)
CORRELATION_ID_KEY = "x-correlation-id"


@dataclass
class ServiceContext:
    """Everything the handlers use; built once at startup."""

    loop: EngineLoop
    spec: EngineSpec
    tokenizer: Tokenizer
    metrics: Metrics
    limits: ServingLimits
    model_kind: ModelKind
    permits: Permits
    tokenization_executor: Executor
    default_include_stop_seqs: bool = True
    compiled: bool = False  # PT2_COMPILE
    adapters: AdapterStore | None = None  # PREFIX_STORE_PATH (SPEC §8); None: ids are refused
    drain: DrainGate = field(default_factory=DrainGate)
    tracing: Tracing = field(default_factory=Tracing)
    grammars: GrammarCache | None = None  # guided decoding; None: constraints are refused
    rng: random.Random = field(default_factory=random.Random)  # seeds for sampling requests without one
    _delivery: EventDelivery | None = field(default=None, init=False, repr=False)

    # ---- what every front door (gRPC, HTTP) does the same way --------------------------------------

    def hold_permits(self, count: int) -> Permits.Held:
        """`count` concurrency permits, or Model is overloaded (counted as a conc_limit failure)."""
        held = self.permits.try_hold(count)
        if held is None:
            self.metrics.request_failure.labels(err="conc_limit").inc()
            raise OverloadedError(Msg.OVERLOADED)
        return held

    def supported_adapter(self, adapter: Adapter, adapter_id: str) -> Adapter:
        """The loaded adapter, if the engine can serve its kind (else the lookup error naming why)."""
        spec = self.spec
        if isinstance(adapter, LoraAdapter) and not spec.supports_lora:
            reason = (
                Msg.LORA_UNSUPPORTED_COMPILED
                if self.compiled
                else Msg.LORA_UNSUPPORTED_BY_ENGINE.format(engine=spec.engine_name)
            )
        elif isinstance(adapter, PrefixEmbeddings) and not spec.supports_prefixes:
            reason = Msg.PREFIX_UNSUPPORTED_BY_ENGINE.format(engine=spec.engine_name)
        else:
            return adapter
        raise ValidationError(Msg.PREFIX_LOOKUP.format(id=adapter_id, reason=reason))

    async def compiled_guide(self, constraint: Constraint | None) -> object:
        """The compiled grammar of a guided-decoding constraint (None without one), off the loop."""
        if constraint is None:
            return None
        if self.grammars is None:
            raise ValidationError(Msg.GUIDED_INVALID.format(field=constraint.kind, error="not enabled"))
        return await self.grammars.compile(constraint)

    def submit(self, inputs: Sequence[ValidatedInput], arrival: float) -> list[Submitted]:
        """Hand the inputs to the loop; each one's events arrive on its own asyncio queue."""
        aio_loop = asyncio.get_running_loop()
        if self._delivery is None or self._delivery.loop is not aio_loop:
            self._delivery = EventDelivery(aio_loop)
        submitted = []
        for validated in inputs:
            events: asyncio.Queue[GenerationEvent] = asyncio.Queue()
            task = GenerationTask(validated, arrival, self._delivery.sink(events))
            submitted.append(Submitted(task, events))
        self.loop.submit([s.task for s in submitted])
        return submitted

    def check_params(self, params: GenerationParams) -> None:
        """SPEC §3.1's checks of the call's parameters, against this server's MAX_NEW_TOKENS."""
        validate_params(params, max_new_tokens_limit=self.limits.max_new_tokens)

    def validated_input(
        self,
        text: str,
        ids: Sequence[int],
        params: GenerationParams,
        *,
        adapter: Adapter | None,
        adapter_id: str | None,
        guide: object,
    ) -> ValidatedInput:
        """SPEC §3.1 #15–#16 for one input: its raw length counted, TRUNCATE_INPUT_TOKENS applied, checked."""
        self.metrics.request_raw_input_length.observe(len(ids))
        encoder_decoder = self.model_kind == ModelKind.ENCODER_DECODER
        return validate_input(
            text,
            self.tokenizer.truncate(ids, params.truncate_input_tokens),
            params,
            adapter=adapter,
            adapter_id=adapter_id,
            prefix_length=adapter.length(encoder_decoder) if isinstance(adapter, PrefixEmbeddings) else 0,
            max_sequence_length=self.limits.max_sequence_length,
            rng=self.rng,
            guide=guide,
        )

    def observe_validated(self, validated: Sequence[ValidatedInput], started: float) -> None:
        """The validated inputs' lengths and budgets, and the validation time since `started`."""
        for v in validated:
            self.metrics.request_input_length.observe(len(v.input_ids))
            self.metrics.request_max_new_tokens.observe(v.max_new_tokens)
            self.metrics.request_validation_duration.observe(time.monotonic() - started)

    def record_success(self, kind: str, finals: Sequence[Final], arrival: float) -> None:
        for final in finals:
            reason = StopReason(final.stop_reason)
            self.metrics.request_success.labels(stop_reason=reason.name, kind=kind).inc()
        self.metrics.request_duration.observe(time.monotonic() - arrival)


@dataclass
class Submitted:
    """One input in the loop; `events` receives its GenerationEvents from the loop thread."""

    task: GenerationTask
    events: asyncio.Queue[GenerationEvent]


Final = pb.GenerationResponse | TokenEvent


@dataclass
class RequestCall:
    """One call's request log line and trace span, filled in as the call goes (gRPC and HTTP)."""

    record: RequestRecord
    span: RequestSpan

    @contextlib.contextmanager
    def validating(self) -> Iterator[None]:
        started = time.monotonic()
        with self.span.validation():
            yield
        self.record.validation_time = time.monotonic() - started

    def finish(self, tasks: Sequence[GenerationTask], finals: Sequence[Final]) -> None:
        outcomes = []
        for task, final in zip(tasks, finals, strict=True):
            self.span.phases(task.queued_at, task.admitted_at, task.finished_at)
            outcomes.append(
                InputOutcome(
                    input_tokens=len(task.input.input_ids),
                    generated_tokens=final.generated_token_count,
                    stop_reason=StopReason(final.stop_reason).name,
                    queue_time=_between(task.queued_at, task.admitted_at),
                    inference_time=_between(task.admitted_at, task.finished_at),
                )
            )
        self.span.set_attributes(
            input_tokens=sum(o.input_tokens for o in outcomes),
            generated_tokens=sum(o.generated_tokens for o in outcomes),
            stop_reason=",".join(o.stop_reason for o in outcomes),
        )
        self.span.end()
        self.record.finish(outcomes)

    def fail(self, error: str) -> None:
        self.span.end(error)
        self.record.fail(error)


def _between(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None


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
        async with (
            self._errors_as_status(context, call),
            self.ctx.drain.admit(),
            self.ctx.hold_permits(count),
        ):
            with call.validating():
                params = call.record.params = self._params(request)
                inputs = await self._validate(request, params, texts)
            submitted = self.ctx.submit(inputs, arrival)
            try:
                answers = [await self._collect(s) for s in submitted]
            finally:
                for s in submitted:
                    s.task.cancelled = True  # a no-op once finished; frees the slot if the client left
            self.ctx.record_success("single" if count == 1 else "batch", answers, arrival)
            call.finish([s.task for s in submitted], answers)
            return pb.BatchedGenerationResponse(responses=answers)

    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        arrival = time.monotonic()
        self.ctx.metrics.request_count.labels(kind="stream").inc()
        call = self._call("GenerateStream", context, [request.request.text], arrival)
        async with self._errors_as_status(context, call), self.ctx.drain.admit():
            if not request.HasField("request"):
                raise ValidationError(Msg.MISSING_REQUEST)
            self.ctx.metrics.request_input_count.inc()
            async with self.ctx.hold_permits(1):
                with call.validating():
                    params = call.record.params = self._params(request)
                    (validated,) = await self._validate(request, params, [request.request.text])
                input_text = validated.text if params.response.input_text else None
                yield responses.stream_first_message(
                    input_token_count=len(validated.input_ids), input_text=input_text, seed=validated.seed
                )
                (submitted,) = self.ctx.submit([validated], arrival)
                try:
                    async for message in self._stream_messages(submitted, arrival, call):
                        yield message
                finally:
                    submitted.task.cancelled = True

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
                    *(self._encode(r.text, with_offsets=with_offsets) for r in request.requests)
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

    def _params(self, request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest) -> GenerationParams:
        message = request.params if request.HasField("params") else None
        params = effective_params(message, default_include_stop_seqs=self.ctx.default_include_stop_seqs)
        self.ctx.check_params(params)
        return params

    async def _guide(self, request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest) -> object:
        """The request's compiled guided-decoding grammar (None without one), compiled off the loop."""
        return await self.ctx.compiled_guide(
            constraint_of(request.params if request.HasField("params") else None)
        )

    async def _validate(
        self,
        request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest,
        params: GenerationParams,
        texts: Sequence[str],
    ) -> list[ValidatedInput]:
        started = time.monotonic()
        adapter_id = request.adapter_id or request.prefix_id
        adapter = await self._adapter(adapter_id)
        guide = await self._guide(request)
        try:
            encodings = await asyncio.gather(*(self._encode(text) for text in texts))
        except Exception as exc:
            raise ValidationError(Msg.TOKENIZER.format(error=exc)) from exc
        validated = [
            self.ctx.validated_input(
                text, encoding.ids, params, adapter=adapter, adapter_id=adapter_id or None, guide=guide
            )
            for text, encoding in zip(texts, encodings, strict=True)
        ]
        self.ctx.observe_validated(validated, started)
        return validated

    async def _adapter(self, adapter_id: str) -> Adapter | None:
        """SPEC §3.1 #13: the request's prefix or LoRA adapter (`adapter_id` wins), loaded off the loop."""
        if not adapter_id:
            return None
        store = self.ctx.adapters
        if store is None:
            raise ValidationError(Msg.ADAPTER_STORE_MISSING)
        try:
            adapter = await run_torch_work(lambda: store.get(adapter_id), name="adapter-load")
        except AdapterLoadError as exc:
            raise ValidationError(Msg.PREFIX_LOOKUP.format(id=adapter_id, reason=exc.reason)) from exc
        return self.ctx.supported_adapter(adapter, adapter_id)

    async def _encode(self, text: str, *, with_offsets: bool = False) -> Encoding:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.ctx.tokenization_executor, lambda: self.ctx.tokenizer.encode(text, with_offsets=with_offsets)
        )

    async def _collect(self, submitted: Submitted) -> pb.GenerationResponse:
        validated = submitted.task.input
        token_events: list[TokenEvent] = []
        input_tokens: tuple[TokenInfo, ...] = ()
        while True:
            event = await submitted.events.get()
            if isinstance(event, FailureEvent):
                raise GenerationError(event.message)
            if isinstance(event, InputTokensEvent):
                input_tokens = event.tokens
                continue
            token_events.append(event)
            if event.finished:
                break
        prefix = ""
        queued_out = (
            token_events[-1].stop_reason == StopReason.TIME_LIMIT
            and token_events[-1].generated_token_count == 0
        )
        if validated.params.response.input_text and not queued_out:
            separator = "\n\n" if self.ctx.model_kind == ModelKind.ENCODER_DECODER else ""
            prefix = validated.text + separator
        return responses.unary_response(
            input_token_count=len(validated.input_ids),
            events=token_events,
            input_tokens=input_tokens,
            text_prefix=prefix,
            seed=validated.seed,
        )

    async def _stream_messages(
        self, submitted: Submitted, arrival: float, call: RequestCall
    ) -> AsyncIterator[pb.GenerationResponse]:
        seed = submitted.task.input.seed
        while True:
            event = await submitted.events.get()
            if isinstance(event, FailureEvent):
                raise GenerationError(event.message)
            if isinstance(event, InputTokensEvent):
                yield responses.stream_input_tokens_message(event.tokens)
                continue
            yield responses.stream_token_message(event, seed=seed)
            if event.finished:
                self.ctx.record_success("stream", [event], arrival)
                call.finish([submitted.task], [event])
                return

    # ---- cross-cutting ------------------------------------------------------------------------------

    def _errors_as_status(self, context: grpc.aio.ServicerContext, call: RequestCall | None) -> _StatusMapper:
        return _StatusMapper(context, self.ctx.metrics, call)

    def _call(
        self, method: str, context: grpc.aio.ServicerContext, texts: Sequence[str], arrival: float
    ) -> RequestCall:
        metadata = [(m.key, m.value) for m in context.invocation_metadata() or ()]
        correlation_id = next((str(v) for k, v in metadata if k == CORRELATION_ID_KEY), None)
        correlation_id = correlation_id or uuid.uuid4().hex  # generated when the client sent none
        REQUEST_ID.set(correlation_id)  # this call's task: every line it logs carries the id
        context.set_trailing_metadata(((CORRELATION_ID_KEY, correlation_id),))
        span = self.ctx.tracing.request(method, metadata)
        span.set_attributes(correlation_id=correlation_id, inputs=len(texts))
        record = RequestRecord(method, correlation_id, arrival, input_chars=[len(t) for t in texts])
        return RequestCall(record, span)


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
