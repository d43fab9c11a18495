"""OpenTelemetry request spans (validation, queue, inference children) and W3C context from metadata."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.resources import SERVICE_NAME
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.ops.serving import OpsServer
from tgis.pb import generation_pb2 as pb
from tgis.tracing import NO_SPAN, OtelTracing, Tracing, create_tracing

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def server(model_dirs, exporter: InMemorySpanExporter) -> Iterator[OpsServer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with OpsServer(model_dirs("gpt2"), tracing=OtelTracing(provider)) as running:
        yield running


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    exporter.clear()
    yield exporter


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def test_a_generate_call_is_one_span_with_validation_queue_and_inference_children(
    server: OpsServer, spans: InMemorySpanExporter
) -> None:
    server.stub().Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="trace me")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=3, min_new_tokens=3)),
        ),
        metadata=[("traceparent", TRACEPARENT), ("x-correlation-id", "t-1"), ("x-request-id", "r-1")],
        timeout=60,
    )
    named = by_name(spans.get_finished_spans())
    (root,) = named["Generate"]
    assert root.kind == SpanKind.SERVER
    assert root.context.trace_id == TRACE_ID
    assert root.parent is not None and root.parent.span_id == PARENT_SPAN_ID
    assert root.attributes is not None
    assert root.attributes["correlation_id"] == "t-1"
    assert root.attributes["request_id"] == "r-1"
    assert root.attributes["generated_tokens"] == 3
    assert root.attributes["stop_reason"] == "MAX_TOKENS"
    children = [named[name][0] for name in ("validation", "queue", "inference")]
    for child in children:
        assert child.context.trace_id == TRACE_ID
        assert child.parent is not None and child.parent.span_id == root.context.span_id
    validation, queue, inference = children
    times = [(span.start_time or 0, span.end_time or 0) for span in (root, validation, queue, inference)]
    (root_start, root_end), (v_start, v_end), (q_start, q_end), (i_start, i_end) = times
    slack = 1_000_000  # 1 ms: live spans read the wall clock, queue/inference come from the loop's clock
    assert root_start <= v_start <= v_end <= q_start + slack
    assert q_start <= q_end <= i_start <= i_end <= root_end + slack


def test_a_stream_without_trace_context_starts_a_new_trace(
    server: OpsServer, spans: InMemorySpanExporter
) -> None:
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text="stream"),
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2)),
    )
    list(server.stub().GenerateStream(request, timeout=60))
    named = by_name(spans.get_finished_spans())
    (root,) = named["GenerateStream"]
    assert root.parent is None
    assert {"validation", "queue", "inference"} <= set(named)


def test_a_failed_call_ends_its_span_with_an_error_status(
    server: OpsServer, spans: InMemorySpanExporter
) -> None:
    with pytest.raises(grpc.RpcError):
        server.stub().Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="x")],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1, min_new_tokens=2)),
            ),
            timeout=60,
        )
    (root,) = by_name(spans.get_finished_spans())["Generate"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.status.description == "min_new_tokens must be <= max_new_tokens"


def test_tracing_is_off_without_an_endpoint_and_spans_are_shared_no_ops() -> None:
    tracing = create_tracing(None, "text-generation-inference.router")
    assert type(tracing) is Tracing and not tracing.enabled
    span = tracing.request("Generate", [("traceparent", TRACEPARENT)])
    assert span is NO_SPAN
    with span.validation():
        span.phases(0.0, 1.0, 2.0)
    span.end("nothing happens")


def test_an_endpoint_turns_on_otlp_export_under_the_service_name() -> None:
    tracing = create_tracing("http://127.0.0.1:4317", "my-tgis")
    try:
        assert isinstance(tracing, OtelTracing) and tracing.enabled
        assert tracing.provider.resource.attributes[SERVICE_NAME] == "my-tgis"
    finally:
        tracing.shutdown()
