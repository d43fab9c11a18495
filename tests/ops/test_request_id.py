"""Each generation call has a request id: the client's x-correlation-id or a generated one, echoed in
the response's trailing metadata and carried by every log line of the call, in text and JSON."""

from __future__ import annotations

import io
import json
import logging
import re

from tests.ops.serving import OpsServer
from tests.ops.test_metrics_scrape import fixed_length
from tgis.logs import log_handler
from tgis.pb import generation_pb2 as pb

REQUEST = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="one two")], params=fixed_length(2))
STREAM = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="three"), params=fixed_length(2))


def echoed(trailing) -> str:
    return dict(trailing)["x-correlation-id"]


def test_request_ids_are_echoed_and_logged_in_text_and_json(model_dirs) -> None:
    text, lines = io.StringIO(), io.StringIO()
    handlers = [log_handler(False, text), log_handler(True, lines)]
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    for handler in handlers:
        root.addHandler(handler)
    try:
        with OpsServer(model_dirs("gpt2")) as server:
            stub = server.stub()
            _, call = stub.Generate.with_call(REQUEST, timeout=60)
            generated = echoed(call.trailing_metadata())
            _, call = stub.Generate.with_call(
                REQUEST, metadata=(("x-correlation-id", "abc-123"),), timeout=60
            )
            given = echoed(call.trailing_metadata())
            stream = stub.GenerateStream(STREAM, timeout=60)
            list(stream)
            streamed = echoed(stream.trailing_metadata())
    finally:
        for handler in handlers:
            root.removeHandler(handler)
        root.setLevel(level)
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert given == "abc-123"
    assert re.fullmatch(r"[0-9a-f]{32}", streamed) and streamed != generated
    request_lines = [line for line in text.getvalue().splitlines() if "tgis.requests" in line]
    assert [line.rsplit(" request_id=", 1)[1] for line in request_lines] == [generated, given, streamed]
    entries = [json.loads(line) for line in lines.getvalue().splitlines()]  # every line is JSON
    assert [e["request_id"] for e in entries if e["target"] == "tgis.requests"] == [
        generated,
        given,
        streamed,
    ]
    assert [e["fields"]["correlation_id"] for e in entries if e["target"] == "tgis.requests"] == [
        generated,
        given,
        streamed,
    ]
    assert all("request_id" not in e for e in entries if e["target"] == "tgis.app")


def test_x_request_id_names_the_call_on_both_doors_and_comes_back(model_dirs) -> None:
    """x-request-id (gRPC metadata, HTTP header) is the id logs carry; it comes back in the initial and
    trailing metadata and the response headers, beside x-correlation-id, which keeps TGIS's meaning."""
    import urllib.request

    text = io.StringIO()
    handler = log_handler(True, text)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        with OpsServer(model_dirs("gpt2")) as server:
            stream = server.stub().GenerateStream(
                STREAM, metadata=(("x-request-id", "req-7"), ("x-correlation-id", "corr-7")), timeout=60
            )
            initial = dict(stream.initial_metadata())
            list(stream)
            trailing = dict(stream.trailing_metadata())
            port = server.server.http_port

            def post(headers: dict[str, str]) -> dict[str, str]:
                body = json.dumps({"inputs": "one", "parameters": {"max_new_tokens": 2}}).encode()
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/generate",
                    data=body,
                    headers={"Content-Type": "application/json", **headers},
                )
                with urllib.request.urlopen(request, timeout=60) as response:
                    return {k.lower(): v for k, v in response.headers.items()}

            given = post({"X-Request-Id": "http-1"})
            generated = post({})
            too_long = post({"X-Request-Id": "x" * 300})
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    for metadata in (initial, trailing):
        assert metadata["x-request-id"] == "req-7" and metadata["x-correlation-id"] == "corr-7"
    assert given["x-request-id"] == given["x-correlation-id"] == "http-1"
    assert re.fullmatch(r"[0-9a-f]{32}", generated["x-request-id"])
    assert generated["x-correlation-id"] == generated["x-request-id"]
    assert too_long["x-request-id"] != "x" * 300  # an id that cannot be echoed as it came is replaced
    entries = [json.loads(line) for line in text.getvalue().splitlines()]
    requests = [e for e in entries if e["target"] == "tgis.requests"]
    assert [e["request_id"] for e in requests] == [
        "req-7",
        "http-1",
        generated["x-request-id"],
        too_long["x-request-id"],
    ]
    assert requests[0]["fields"]["correlation_id"] == "corr-7"
    assert requests[0]["fields"]["request_id"] == "req-7"
