"""Property-based fuzzing of one running server: no request, however odd, takes it down.

Random `Parameters` over gRPC (NaN, ±inf, -0.0, denormals, extreme integers, empty and huge strings,
invalid UTF-8 in stop sequences, random guided-decoding constraints, adapter ids) and random JSON
bodies on the OpenAI and TGI routes (NaN/Infinity literals, wrong types, deep nesting, invalid
UTF-8, empty bodies). Every answer must be a success or a client error: never INTERNAL, UNKNOWN or
a 5xx, never a hang, and /health stays 200 throughout. Afterwards a plain request still equals
transformers' generate().

The example counts are bounded for CI; TGIS_FUZZ_EXAMPLES raises them (the 10,000-request runs of
the robustness issue set it).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.fixtures.adapters import write_lora, write_raw_prefix
from tests.integration import reference
from tests.integration.harness import ServerThread, wait_until
from tgis.pb import generation_pb2 as pb

EXAMPLES = int(os.environ.get("TGIS_FUZZ_EXAMPLES", "120"))
CALL_TIMEOUT_SECONDS = 60.0  # a call that takes longer counts as a hang
MAX_NEW_TOKENS = 6
MAX_SEQUENCE_LENGTH = 96
FORBIDDEN_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
PROMPT = "The quick brown fox"
ADAPTERS = ("fz-prefix", "fz-lora")
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("TGIS_FUZZ_EXAMPLES") is None,  # CI: the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzzed(model_dirs, tmp_path_factory) -> Iterator[tuple[ServerThread, Path]]:
    model_dir = model_dirs("gpt2")
    store = tmp_path_factory.mktemp("fuzz-store")
    hidden = json.loads((model_dir / "config.json").read_text())["n_embd"]
    write_raw_prefix(
        store, ADAPTERS[0], decoder=torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    )
    write_lora(store, ADAPTERS[1], model_dir, seed=2)
    server = ServerThread(
        model_dir,
        max_new_tokens=MAX_NEW_TOKENS,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        prefix_store_path=str(store),
        http_request_timeout=CALL_TIMEOUT_SECONDS / 2,
    )
    try:
        yield server, model_dir
        assert server.loop.alive, "the engine loop died during the fuzz"
        expected = reference.greedy(model_dir, PROMPT, MAX_NEW_TOKENS)
        params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS))
        request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)], params=params)
        (answer,) = server.stub.Generate(request, timeout=CALL_TIMEOUT_SECONDS).responses
        assert answer.text == expected.text
        assert answer.generated_token_count == expected.generated_token_count
        # The answer leaves before the loop thread frees the request's blocks.
        wait_until(lambda: _kv_blocks_used(server) == 0, "every KV block is free again", timeout=10)
    finally:
        server.stop()


def _kv_blocks_used(server: ServerThread) -> float:
    _, text = server.http_get("/metrics")
    for line in text.decode().splitlines():
        if line.startswith('tgi_kv_cache_blocks{state="used"}'):
            return float(line.split()[-1])
    return 0.0


def _assert_healthy(server: ServerThread) -> None:
    status, body = server.http_get("/health")
    assert status == 200, f"/health answered {status}: {body!r}"
    assert server.loop.alive


# ---- gRPC ---------------------------------------------------------------------------------------

odd_floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.sampled_from([0.0, -0.0, 1.0, 0.05, 0.5, 2.0, 1e-45, -1e-45, 3.4e38, -3.4e38]),
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
)
uint32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 5, 2**31 - 1, 2**31, 2**32 - 1]))
uint64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]))
texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", " ", "\x00", "\ud7ff\ue000", "é👋", "x" * 3000, "<|endoftext|>", "\n\n"]),
)
schemas = st.one_of(
    texts,
    st.sampled_from(
        [
            '{"type": "object", "properties": {"a": {"type": "integer"}}}',
            '{"type": "string", "maxLength": 3}',
            '{"type": "array", "items": {"type": "boolean"}, "maxItems": 2}',
            '{"enum": ["x", "y"]}',
            '{"type": "number", "minimum": NaN}',
            '{"$ref": "#/nowhere"}',
            "[" * 2000,
        ]
    ),
)
guided = st.one_of(
    st.none(),
    st.builds(lambda f: {"format": f}, st.sampled_from([0, 1, 7])),
    st.builds(lambda s: {"json_schema": s}, schemas),
    st.builds(lambda s: {"regex": s}, st.one_of(texts, st.sampled_from(["[0-9]{2}", "(a|b)*c", "(", "\\"]))),
    st.builds(
        lambda c: {"choice": pb.DecodingParameters.StringChoices(choices=c)}, st.lists(texts, max_size=4)
    ),
    st.builds(lambda s: {"grammar": s}, st.one_of(texts, st.just('root ::= "yes" | "no"'))),
)


# Each field draws a legal value, except the one or two fields an example makes odd: an odd value
# then reaches the engine instead of failing an earlier rule.
LEGAL: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.sampled_from([0.05, 0.7, 1.0, 2.0, 0.0]),
    "top_k": st.sampled_from([0, 1, 5, 1000]),
    "top_p": st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    "typical_p": st.sampled_from([0.0, 0.5, 1.0, -1.0]),
    "seed": uint64,
    "repetition_penalty": st.sampled_from([0.0, 1.0, 1.2, 0.5]),
    "decay_factor": st.sampled_from([1.0, 1.5, 10.0]),
    "start_index": st.sampled_from([0, 1, 3]),
    "max_new_tokens": st.integers(0, MAX_NEW_TOKENS),
    "min_new_tokens": st.integers(0, 2),
    "time_limit_millis": st.sampled_from([0, 0, 1, 1000]),
    "stop_sequences": st.lists(st.sampled_from(["the", "e", ".", "\n"]), max_size=2),
    "top_n_tokens": st.integers(0, 3),
    "truncate_input_tokens": st.integers(0, 4),
    "guided": st.one_of(st.none(), st.just({"format": 1}), st.just({"regex": "[a-z]{1,3}"})),
}
ODD: dict[str, st.SearchStrategy[Any]] = {
    "temperature": odd_floats,
    "top_k": uint32,
    "top_p": odd_floats,
    "typical_p": odd_floats,
    "seed": uint64,
    "repetition_penalty": odd_floats,
    "decay_factor": odd_floats,
    "start_index": uint32,
    "max_new_tokens": uint32,
    "min_new_tokens": uint32,
    "time_limit_millis": uint32,
    "stop_sequences": st.lists(texts, max_size=8),
    "top_n_tokens": uint32,
    "truncate_input_tokens": uint32,
    "guided": guided,
}


@st.composite
def parameters(draw) -> pb.Parameters:
    odd = draw(st.sets(st.sampled_from(sorted(ODD)), min_size=1, max_size=2))

    def value(name: str) -> Any:
        return draw(ODD[name] if name in odd else LEGAL[name])

    decoding = pb.DecodingParameters(
        repetition_penalty=value("repetition_penalty"), **(value("guided") or {})
    )
    if draw(st.booleans()):
        decoding.length_penalty.start_index = value("start_index")
        decoding.length_penalty.decay_factor = value("decay_factor")
    sampling = pb.SamplingParameters(top_k=value("top_k"), top_p=value("top_p"), typical_p=value("typical_p"))
    if draw(st.booleans()):
        sampling.temperature = value("temperature")
    if draw(st.booleans()):
        sampling.seed = value("seed")
    return pb.Parameters(
        method=draw(st.sampled_from([pb.GREEDY, pb.SAMPLE])),
        sampling=sampling,
        stopping=pb.StoppingCriteria(
            max_new_tokens=value("max_new_tokens"),
            min_new_tokens=value("min_new_tokens"),
            time_limit_millis=value("time_limit_millis"),
            stop_sequences=value("stop_sequences"),
            include_stop_sequence=draw(st.booleans()),
        ),
        response=pb.ResponseOptions(
            input_text=draw(st.booleans()),
            generated_tokens=draw(st.booleans()),
            input_tokens=draw(st.booleans()),
            token_logprobs=draw(st.booleans()),
            token_ranks=draw(st.booleans()),
            top_n_tokens=value("top_n_tokens"),
        ),
        decoding=decoding,
        truncate_input_tokens=value("truncate_input_tokens"),
    )


adapter_ids = st.one_of(
    st.none(),
    st.none(),
    st.none(),
    st.sampled_from([*ADAPTERS, "missing", "../../etc", "a" * 300, "", "é"]),
    texts,
)


def _call(server: ServerThread, call: Any) -> None:
    """Run one RPC; a client error is fine, a server error or a hang fails the test."""
    try:
        call()
    except grpc.RpcError as error:
        code = error.code()  # type: ignore[attr-defined]
        assert code not in FORBIDDEN_CODES, f"{code}: {error.details()}"  # type: ignore[attr-defined]
        event(f"{code.name}: {error.details()[:40]}")  # type: ignore[attr-defined]
    else:
        event("OK")


@FUZZ_SETTINGS
@given(params=parameters(), adapter_id=adapter_ids, inputs=st.lists(texts, min_size=0, max_size=3))
def test_grpc_generate_survives_any_parameters(fuzzed, params, adapter_id, inputs) -> None:
    server, _ = fuzzed
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text) for text in inputs], params=params
    )
    if adapter_id is not None:
        request.adapter_id = adapter_id
    _call(server, lambda: server.stub.Generate(request, timeout=CALL_TIMEOUT_SECONDS))
    _assert_healthy(server)


@FUZZ_SETTINGS
@given(params=parameters(), adapter_id=adapter_ids, text=texts)
def test_grpc_stream_survives_any_parameters(fuzzed, params, adapter_id, text) -> None:
    server, _ = fuzzed
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=params)
    if adapter_id is not None:
        request.prefix_id = adapter_id
    _call(server, lambda: list(server.stub.GenerateStream(request, timeout=CALL_TIMEOUT_SECONDS)))
    _assert_healthy(server)


MARKER = "\x01STOP-MARKER\x02"


@FUZZ_SETTINGS
@given(bad=st.one_of(st.binary(min_size=1, max_size=8), st.sampled_from([b"\xed\xa0\x80", b"\xff", b"\xc3"])))
def test_grpc_invalid_utf8_in_stop_sequences_is_a_client_error(fuzzed, bad) -> None:
    """A client that sends bytes that are not UTF-8 in a string field (a lone surrogate's encoding,
    a truncated sequence) gets INVALID_ARGUMENT, not the framework's INTERNAL."""
    server, _ = fuzzed
    params = pb.Parameters(stopping=pb.StoppingCriteria(stop_sequences=[MARKER], max_new_tokens=2))
    message = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)], params=params)
    raw = message.SerializeToString()
    marker = MARKER.encode()
    payload = (bad * len(marker))[: len(marker)]
    raw = raw.replace(marker, payload)
    generate = server.channel.unary_unary(
        "/fmaas.GenerationService/Generate",
        request_serializer=None,
        response_deserializer=pb.BatchedGenerationResponse.FromString,
    )
    try:
        payload.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    try:
        generate(raw, timeout=CALL_TIMEOUT_SECONDS)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()  # type: ignore[attr-defined]
        assert not valid or "stop" in error.details()  # type: ignore[attr-defined]
    else:
        assert valid
    _assert_healthy(server)


# ---- HTTP ---------------------------------------------------------------------------------------

ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream")
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
FIELDS = (
    "max_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "typical_p",
    "seed",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "repetition_penalty",
    "min_tokens",
    "stream",
    "logprobs",
    "top_logprobs",
    "echo",
    "best_of",
    "do_sample",
    "details",
    "decoder_input_details",
    "top_n_tokens",
    "truncate",
    "watermark",
    "grammar",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "response_format",
    "stream_options",
    "ignore_eos",
    "max_completion_tokens",
    "model",
)
odd_numbers = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308, 2**64, -(2**63), 0, 1, 2])


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["shaped", "shaped", "shaped", "raw", "deep", "empty", "overflow"]))
    if kind == "empty":
        return b""
    if kind == "deep":
        depth = draw(st.integers(50, 100_000))
        return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "overflow":
        field = draw(st.sampled_from(FIELDS))
        literal = draw(
            st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "18446744073709551616"])
        )
        messages = '[{"role": "user", "content": "hi"}]'
        return f'{{"prompt": "hi", "inputs": "hi", "messages": {messages}, "{field}": {literal}}}'.encode()
    body: dict[str, Any] = {}
    body["prompt"] = draw(st.one_of(texts, json_values, st.lists(st.integers(-5, 70000), max_size=4)))
    body["inputs"] = draw(st.one_of(texts, json_values))
    body["messages"] = draw(
        st.one_of(
            json_values, st.lists(st.fixed_dictionaries({"role": texts, "content": json_values}), max_size=2)
        )
    )
    parameters = {
        name: draw(st.one_of(odd_numbers, json_values))
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=5))
    }
    body.update(parameters)
    body["parameters"] = dict(parameters)
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        raw = raw.replace(b"hi", draw(st.sampled_from([b"\xff\xfe", b"\xed\xa0\x80", b"\xc3("])))
    return raw


@FUZZ_SETTINGS
@given(route=st.sampled_from(ROUTES), body=bodies())
def test_http_routes_survive_any_body(fuzzed, route, body) -> None:
    server, _ = fuzzed
    status, _, raw = server.http_post(route, body)
    event(f"{route} {status}")
    assert status < 500, f"{route} answered {status}: {raw[:300]!r}"
    if status >= 400:
        error = json.loads(raw)["error"]
        assert error, "an error answer carries a message"
    else:
        assert b'"InternalServerError"' not in raw and b'"error_type":"generation"' not in raw, raw[:300]
    _assert_healthy(server)


def test_a_client_that_never_finishes_its_body_blocks_nobody(fuzzed) -> None:
    """Headers, half a body, then silence: other HTTP and gRPC requests go on meanwhile."""
    server, _ = fuzzed
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as stalled:
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "half'
        )
        started = time.monotonic()
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": MAX_NEW_TOKENS}}
        status, _, raw = server.http_post("/generate", json.dumps(body).encode())
        assert status == 200, raw
        params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW_TOKENS))
        request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)], params=params)
        assert server.stub.Generate(request, timeout=CALL_TIMEOUT_SECONDS).responses
        assert time.monotonic() - started < CALL_TIMEOUT_SECONDS / 2
    _assert_healthy(server)
