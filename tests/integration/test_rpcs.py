"""Tokenize, ModelInfo, admission errors, health, reflection and HTTP through the real server."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb


def rpc_error(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        result = call(request, timeout=30)
        if not isinstance(result, pb.BatchedGenerationResponse):
            list(result)  # drain a stream so its status arrives
    return error.value


def test_tokenize_returns_counts_raw_tokens_and_utf8_byte_offsets(server_for, model_dirs):
    server = server_for("llama")
    hf = AutoTokenizer.from_pretrained(model_dirs("llama"))
    text = "héllo 👋 wörld"
    answer = server.stub.Tokenize(
        pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=text), pb.TokenizeRequest(text="plain")],
            return_tokens=True,
            return_offsets=True,
        ),
        timeout=30,
    )
    first = answer.responses[0]
    ids = hf(text)["input_ids"]
    assert first.token_count == len(ids) == len(first.tokens) == len(first.offsets)
    assert list(first.tokens) == hf.convert_ids_to_tokens(ids)
    assert (first.offsets[0].start, first.offsets[0].end) == (0, 0)  # BOS is special
    encoded = text.encode("utf-8")
    assert first.offsets[-1].end == len(encoded)  # byte offsets, not character offsets
    for offset in first.offsets[1:]:
        assert 0 <= offset.start < offset.end <= len(encoded)
    assert answer.responses[1].token_count == len(hf("plain")["input_ids"])


def test_tokenize_truncation_keeps_the_last_tokens(server_for, model_dirs):
    server = server_for("gpt2")
    hf = AutoTokenizer.from_pretrained(model_dirs("gpt2"))
    text = "The quick brown fox jumps over the lazy dog"
    answer = server.stub.Tokenize(
        pb.BatchedTokenizeRequest(
            requests=[pb.TokenizeRequest(text=text)], return_tokens=True, truncate_input_tokens=3
        ),
        timeout=30,
    )
    assert answer.responses[0].token_count == 3
    assert list(answer.responses[0].tokens) == hf.convert_ids_to_tokens(hf(text)["input_ids"])[-3:]
    assert not answer.responses[0].offsets
    assert not server.stub.Tokenize(pb.BatchedTokenizeRequest(), timeout=30).responses


@pytest.mark.parametrize(
    ("arch", "kind"),
    [("llama", pb.ModelInfoResponse.DECODER_ONLY), ("t5", pb.ModelInfoResponse.ENCODER_DECODER)],
)
def test_model_info_reports_kind_and_effective_limits(server_for, arch, kind):
    info = server_for(arch).stub.ModelInfo(pb.ModelInfoRequest(model_id="ignored"), timeout=30)
    assert info.model_kind == kind
    limits = server_for(arch).server.limits
    assert (info.max_sequence_length, info.max_new_tokens) == (
        limits.max_sequence_length,
        limits.max_new_tokens,
    )
    assert info.max_new_tokens < info.max_sequence_length


def test_generate_with_no_inputs_returns_an_empty_response(server_for):
    assert not server_for("gpt2").stub.Generate(pb.BatchedGenerationRequest(), timeout=30).responses


def test_invalid_parameters_get_invalid_argument_with_the_tgis_message(server_for):
    server = server_for("gpt2")
    limit = server.server.limits.max_new_tokens
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="hi")],
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=limit + 1)),
    )
    error = rpc_error(server.stub.Generate, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"max_new_tokens must be <= {limit}"
    stream_error = rpc_error(server.stub.GenerateStream, pb.SingleGenerationRequest())
    assert (stream_error.code(), stream_error.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "missing request",
    )
    long_text = "word " * 400
    error = rpc_error(
        server.stub.Generate,
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="fine"), pb.GenerationRequest(text=long_text)]
        ),
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().endswith(
        f"plus prefix length (0) must be < {server.server.limits.max_sequence_length}"
    )


def test_more_inputs_than_permits_is_resource_exhausted(model_dirs):
    server = ServerThread(model_dirs("gpt2"), max_concurrent_requests=2)
    try:
        error = rpc_error(
            server.stub.Generate, pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="a")] * 3)
        )
        assert (error.code(), error.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded")
        ok = server.stub.Generate(
            pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="a")] * 2), timeout=30
        )
        assert len(ok.responses) == 2
        assert server.metrics.request_failure.labels(err="conc_limit")._value.get() == 1
    finally:
        server.stop()


@pytest.mark.parametrize(("arch", "separator"), [("gpt2", ""), ("t5", "\n\n")])
def test_input_text_is_echoed_before_the_output(server_for, arch, separator):
    server = server_for(arch)
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=5), response=pb.ResponseOptions(input_text=True)
    )
    plain = server.stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Echo me")], params=pb.Parameters(stopping=params.stopping)
        ),
        timeout=30,
    ).responses[0]
    echoed = server.stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Echo me")], params=params),
        timeout=30,
    ).responses[0]
    assert echoed.text == "Echo me" + separator + plain.text
    first = next(
        iter(
            server.stub.GenerateStream(
                pb.SingleGenerationRequest(request=pb.GenerationRequest(text="Echo me"), params=params),
                timeout=30,
            )
        )
    )
    assert first.text == "Echo me"  # the stream never sends the separator


def test_grpc_health_and_reflection_are_served(server_for):
    server = server_for("gpt2")
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "fmaas.GenerationService"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    replies = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"fmaas.GenerationService", "grpc.health.v1.Health"} <= names


def test_http_health_and_metrics(server_for):
    server = server_for("gpt2")
    server.stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="count me")]), timeout=30
    )
    status, body = server.http_get("/health")
    assert (status, body) == (200, b"")
    status, body = server.http_get("/metrics")
    text = body.decode()
    assert status == 200
    assert 'tgi_request_count_total{kind="single"}' in text
    assert "tgi_batch_inference_forward_duration_bucket" in text


def test_unary_doors_submit_unstreamed_tasks_and_streaming_doors_streamed_ones(server_for, monkeypatch):
    """Unary answers are folded, so their events may wait for the last one (GenerationTask.streamed)."""
    server = server_for("llama")
    loop = server.server.engine_loop
    seen: list[bool] = []
    submit = loop.submit

    def recording(tasks):
        seen.extend(task.streamed for task in tasks)
        return submit(tasks)

    monkeypatch.setattr(loop, "submit", recording)
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=3))
    request = pb.GenerationRequest(text="hello")
    server.stub.Generate(pb.BatchedGenerationRequest(requests=[request, request], params=params), timeout=30)
    assert seen == [False, False]
    list(server.stub.GenerateStream(pb.SingleGenerationRequest(request=request, params=params), timeout=30))
    assert seen[2:] == [True]
    for path, streamed in (("/generate", False), ("/generate_stream", True)):
        body = json.dumps({"inputs": "hello", "parameters": {"max_new_tokens": 3}}).encode()
        status, _, _ = server.http_post(path, body)
        assert status == 200
        assert seen[-1] is streamed
    assert len(seen) == 5
