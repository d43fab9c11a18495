"""HTTP limits: API key, permits (429), body size, disconnects, gateway load gauges, encoder-decoder."""

from __future__ import annotations

import http.client
import json
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.integration import reference
from tests.integration.harness import ServerThread, wait_until

PROMPT = "The quick brown fox jumps over"


def gauges(server: ServerThread) -> dict[str, float]:
    _, text = server.http_get("/metrics")
    values = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name.startswith("vllm:"):
            for sample in family.samples:
                values[sample.name] = sample.value
    return values


def test_api_key_guards_inference_routes_but_not_health(model_dirs) -> None:
    server = ServerThread(model_dirs("gpt2"), api_key="sekrit")
    try:
        body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
        status, _, raw = server.http_post("/v1/completions", body)
        assert status == 401 and "API key" in json.loads(raw)["error"]["message"]
        status, _, _ = server.http_post("/v1/completions", body, {"Authorization": "Bearer wrong"})
        assert status == 401
        status, _, _ = server.http_post("/generate", json.dumps({"inputs": PROMPT}).encode())
        assert status == 401
        assert server.http_get("/health")[0] == 200
        client = server.openai_client("sekrit")
        model = client.models.list().data[0].id
        assert client.completions.create(prompt=PROMPT, model=model, max_tokens=2).usage
    finally:
        server.stop()


def test_body_larger_than_the_limit_is_413(model_dirs) -> None:
    server = ServerThread(model_dirs("gpt2"), http_max_body_bytes=2048)
    try:
        status, _, raw = server.http_post("/v1/completions", json.dumps({"prompt": "x" * 4096}).encode())
        assert status == 413 and "larger than 2048 bytes" in json.loads(raw)["error"]["message"]
    finally:
        server.stop()


def test_a_request_over_the_timeout_is_408_and_frees_its_slot(model_dirs) -> None:
    server = ServerThread(model_dirs("gpt2"), http_request_timeout=0.3)
    engine = server.engine
    real_step = engine.step

    def slow_step(*args, **kwargs):  # every step takes 0.1 s: 50 tokens cannot finish in 0.3 s
        time.sleep(0.1)
        return real_step(*args, **kwargs)

    engine.step = slow_step
    try:
        body = {"prompt": PROMPT, "max_tokens": 50, "min_tokens": 50, "temperature": 0}
        status, _, raw = server.http_post("/v1/completions", json.dumps(body).encode())
        assert status == 408 and "timed out after 0.3s" in json.loads(raw)["error"]["message"]
        wait_until(lambda: server.loop.load().running == 0, "the timed-out request leaves the batch")
        wait_until(lambda: _permits_free(server), "its permit is free")
    finally:
        engine.step = real_step
        server.stop()


def test_encoder_decoder_serves_completions(model_dirs) -> None:
    server = ServerThread(model_dirs("t5"))
    try:
        expected = reference.greedy(model_dirs("t5"), PROMPT, 8)
        client = server.openai_client("x")
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert reply.choices[0].text == expected.text
        assert reply.usage is not None and reply.usage.completion_tokens == expected.generated_token_count
        streamed = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.text
    finally:
        server.stop()


def test_overload_disconnect_and_gateway_gauges(model_dirs) -> None:
    server = ServerThread(model_dirs("llama"), max_concurrent_requests=2, paged_attention=True)
    engine = server.engine
    real_step = engine.step
    steps = threading.Semaphore(0)
    held = threading.Event()  # the loop waits inside a step, and no release is on its way to it

    def paced_step(batch):  # the test releases steps one by one so the load stays put while it looks
        held.set()
        assert steps.acquire(timeout=30)
        return real_step(batch)

    engine.step = paced_step
    port = server.server.http_port
    try:
        assert gauges(server)["vllm:num_requests_running"] == 0
        # 1. A stream that holds a permit.
        streaming = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": PROMPT, "max_tokens": 200, "min_tokens": 200, "temperature": 0, "stream": True}
        streaming.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})

        def released_until(predicate, what: str) -> None:
            def poll() -> bool:
                if predicate():
                    return True
                if held.is_set():  # one step at a time: never more than one release outstanding
                    held.clear()
                    steps.release()
                return False

            wait_until(poll, what)

        released_until(lambda: gauges(server)["vllm:num_requests_running"] == 1, "the stream runs")
        first_event: dict[str, object] = {}

        def read_first_event() -> None:  # blocks until the loop has stepped far enough to emit it
            response = streaming.getresponse()
            first_event.update(status=response.status, head=response.read(5))

        reader = threading.Thread(target=read_first_event)
        reader.start()
        released_until(lambda: not reader.is_alive(), "the stream's first event")
        assert first_event == {"status": 200, "head": b"data:"}
        wait_until(held.is_set, "the loop rests inside a held step")
        # 2. A second request (the second permit) stays queued while the loop is held in its step.
        waiting_result: dict[str, int] = {}

        def second() -> None:
            status, _, _ = server.http_post(
                "/generate",
                json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}).encode(),
            )
            waiting_result["status"] = status

        waiter = threading.Thread(target=second)
        waiter.start()
        wait_until(lambda: gauges(server)["vllm:num_requests_waiting"] == 1, "the second request waits")
        values = gauges(server)
        assert 0 < values["vllm:kv_cache_usage_perc"] <= 1
        assert values["vllm:gpu_cache_usage_perc"] == values["vllm:kv_cache_usage_perc"]
        # 3. No permit left: 429 with Retry-After, OpenAI's error object.
        status, headers, raw = server.http_post("/v1/completions", json.dumps({"prompt": PROMPT}).encode())
        assert status == 429 and headers["Retry-After"] == "1"
        assert json.loads(raw)["error"]["message"] == "Model is overloaded"
        # 4. The streaming client leaves: its slot goes to the waiting request, which finishes.
        streaming.sock.close()
        streaming.close()
        released_until(lambda: not waiter.is_alive(), "the waiting request finishes")
        waiter.join()
        assert waiting_result["status"] == 200
        released_until(
            lambda: server.server.http is not None and server.loop.load().running == 0, "the batch empties"
        )
        wait_until(lambda: gauges(server)["vllm:num_requests_running"] == 0, "the gauges show an idle server")
        assert gauges(server)["vllm:num_requests_waiting"] == 0
        assert gauges(server)["vllm:kv_cache_usage_perc"] == 0
        wait_until(lambda: server.server.http is not None and _permits_free(server), "the permits are free")
        # The loop dropped the stream (not run to its 200 tokens); it is not counted as a success.
        assert server.metrics.request_failure.labels(err="cancelled")._value.get() == 1
        assert (
            server.metrics.request_success.labels(
                stop_reason="MAX_TOKENS", kind="openai_completions"
            )._value.get()
            == 0
        )
    finally:
        engine.step = real_step
        for _ in range(1000):
            steps.release()
        server.stop()


def _permits_free(server: ServerThread) -> bool:
    frontend_permits = server.server.http.api.frontend.ctx.permits  # type: ignore[union-attr]
    return frontend_permits.in_use == 0


NON_FINITE_BODIES = {
    "/v1/completions": '{{"prompt": "hi", "max_tokens": 2, "{field}": {literal}}}',
    "/v1/chat/completions": (
        '{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2, "{field}": {literal}}}'
    ),
    "/generate": '{{"inputs": "hi", "parameters": {{"max_new_tokens": 2, "{field}": {literal}}}}}',
    "/generate_stream": '{{"inputs": "hi", "parameters": {{"max_new_tokens": 2, "{field}": {literal}}}}}',
}


def test_non_finite_numbers_are_a_400_naming_the_field_on_every_route(server_for) -> None:
    """JSON's NaN/Infinity literals and an overflowing 1e999 never reach the sampler."""
    server = server_for("gpt2")
    for route, template in NON_FINITE_BODIES.items():
        for field in ("temperature", "top_p", "repetition_penalty"):
            for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
                body = template.format(field=field, literal=literal).encode()
                status, _, raw = server.http_post(route, body)
                assert status == 400, (route, field, literal, raw)
                error = json.loads(raw)["error"]
                message = error["message"] if isinstance(error, dict) else error
                assert field in message and "finite" in message, (route, message)
    assert server.http_ok() and server.loop.alive


def test_a_deeply_nested_body_is_a_400(server_for) -> None:
    server = server_for("gpt2")
    depth = 100_000
    status, _, raw = server.http_post("/v1/completions", b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")
    assert status == 400
    assert json.loads(raw)["error"]["message"] == "request body is not valid JSON: it is nested too deeply"


def test_a_client_leaving_mid_stream_is_no_server_error(server_for, caplog) -> None:
    """The request is cancelled and its blocks freed; nothing is logged as an error, no 500 is tried."""
    import logging
    import socket

    server = server_for("gpt2")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "min_tokens": 200, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with (
        caplog.at_level(logging.ERROR),
        socket.create_connection(("127.0.0.1", server.server.http_port)) as conn,
    ):
        conn.sendall(head + body)
        received = b""
        while b"data:" not in received:  # the stream has started
            chunk = conn.recv(4096)
            assert chunk, "the server closed the stream"
            received += chunk
    wait_until(lambda: server.loop.load().running == 0, "the abandoned request leaves the batch")
    wait_until(lambda: server.kv_blocks().blocks_used == 0, "its blocks are free")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
