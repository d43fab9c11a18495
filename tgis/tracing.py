"""OpenTelemetry request spans (validation, queue, inference) when OTLP_ENDPOINT is set; no-ops otherwise."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the SDK is imported only when tracing is on: off costs nothing
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

Metadata = Sequence[tuple[str, str | bytes]]


class RequestSpan:
    """One request's span. This base class is the no-op used when tracing is off."""

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        yield

    def phases(self, queued_at: float, admitted_at: float | None, finished_at: float | None) -> None:
        """Queue and inference children of one input, from the loop's monotonic timestamps."""

    def set_attributes(self, **attributes: Any) -> None:
        pass

    def end(self, error: str | None = None) -> None:
        pass


NO_SPAN = RequestSpan()


class Tracing:
    """Starts request spans. This base class, used when OTLP_ENDPOINT is unset, starts none."""

    enabled = False

    def request(self, name: str, metadata: Metadata | None) -> RequestSpan:
        return NO_SPAN

    def shutdown(self) -> None:
        pass


class OtelTracing(Tracing):
    """Spans through an OpenTelemetry TracerProvider; W3C trace context is read from request metadata."""

    enabled = True

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self._tracer = provider.get_tracer("tgis")
        self._propagator = TraceContextTextMapPropagator()

    def request(self, name: str, metadata: Metadata | None) -> RequestSpan:
        from opentelemetry.trace import SpanKind

        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        parent = self._propagator.extract(carrier)
        return _OtelSpan(self._tracer, self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER))

    def shutdown(self) -> None:
        self.provider.shutdown()


class _OtelSpan(RequestSpan):
    def __init__(self, tracer: Tracer, span: Span) -> None:
        from opentelemetry.trace import set_span_in_context

        self._tracer = tracer
        self._span = span
        self._context = set_span_in_context(span)

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        with self._tracer.start_as_current_span("validation", context=self._context):
            yield

    def phases(self, queued_at: float, admitted_at: float | None, finished_at: float | None) -> None:
        # The loop thread timed these; the spans are written afterwards with those times.
        if admitted_at is None:
            return
        offset = time.time_ns() - time.monotonic_ns()  # one offset: the children must not overlap
        self._child("queue", offset, queued_at, admitted_at)
        if finished_at is not None:
            self._child("inference", offset, admitted_at, finished_at)

    def _child(self, name: str, offset: int, start: float, end: float) -> None:
        span = self._tracer.start_span(name, context=self._context, start_time=offset + int(start * 1e9))
        span.end(end_time=offset + int(end * 1e9))

    def set_attributes(self, **attributes: Any) -> None:
        self._span.set_attributes({key: value for key, value in attributes.items() if value is not None})

    def end(self, error: str | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


def create_tracing(otlp_endpoint: str | None, service_name: str) -> Tracing:
    """No-op tracing without an endpoint; else batched OTLP/gRPC export to it."""
    if not otlp_endpoint:
        return Tracing()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return OtelTracing(provider)
