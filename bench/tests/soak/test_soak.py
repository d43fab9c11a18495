"""The soak benchmark without a server: mix and schedule, windows and drift, verdicts, monitor parsing,
the load loops on fake senders, SSE reading against a local aiohttp app, report rendering, flags."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tgis.metrics import Metrics
from tgis_bench.load.results import ModelShape
from tgis_bench.load.workload import LengthRange
from tgis_bench.machine import MachineInfo
from tgis_bench.soak.cli import config_from, parser
from tgis_bench.soak.client import SENDERS, SoakClient, SoakRecord, SoakTarget
from tgis_bench.soak.grpc import Answer
from tgis_bench.soak.http import (
    OPENAI_STREAM,
    TGI_STREAM,
    StreamFormat,
    in_stream_status,
    openai_body,
    post_stream,
    tgi_body,
)
from tgis_bench.soak.load import (
    OpenLoop,
    Saturation,
    Send,
    SoakError,
    probe_saturation,
    saturation,
    warm_up,
)
from tgis_bench.soak.mix import (
    KIND_NAMES,
    KINDS,
    Arrival,
    KindSpec,
    available_kinds,
    draws,
    parse_weights,
    poisson_schedule,
    with_weights,
)
from tgis_bench.soak.monitor import Sample, failure_counts, kv_blocks, log_errors, parse_vm_rss
from tgis_bench.soak.report import (
    MixEntry,
    SoakResults,
    failures_cell,
    render_markdown,
    to_json,
    write_report,
)
from tgis_bench.soak.windows import (
    Verdicts,
    Window,
    bounds,
    is_server_error,
    rss_drift,
    unexpected,
    windows,
)

NEW_TOKENS = LengthRange(8, 24)
MIB = 1024 * 1024


def record(
    kind: str, start: float, latency: float, code: str = "grpc:OK", ttft: float | None = None
) -> SoakRecord:
    return SoakRecord(kind, start, start + latency, ttft, code, 10)


def sample(t: float, rss_mib: float | None, kv: int | None = None) -> Sample:
    return Sample(t, None if rss_mib is None else int(rss_mib * MIB), kv, 0 if kv is not None else None, 0)


# ---- mix and schedule --------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_schedule():
    first = poisson_schedule(5.0, 60, KINDS, prompts=16, new_tokens=NEW_TOKENS, seed=3)
    assert first == poisson_schedule(5.0, 60, KINDS, prompts=16, new_tokens=NEW_TOKENS, seed=3)
    assert first != poisson_schedule(5.0, 60, KINDS, prompts=16, new_tokens=NEW_TOKENS, seed=4)


def test_arrivals_are_poisson_at_the_rate_asked():
    rate, seconds = 10.0, 600.0
    schedule = poisson_schedule(rate, seconds, KINDS, prompts=16, new_tokens=NEW_TOKENS, seed=0)
    times = [a.at for a in schedule]
    assert times == sorted(times) and times[0] > 0 and times[-1] < seconds
    # 6000 expected; a Poisson count's standard deviation is its square root (77).
    assert abs(len(schedule) - rate * seconds) < 4 * (rate * seconds) ** 0.5
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential gaps: the mean and the standard deviation are both 1/rate.
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.08)
    assert [a.index for a in schedule] == list(range(len(schedule)))


def test_kinds_come_in_proportion_to_their_weights():
    schedule = poisson_schedule(20.0, 1000, KINDS, prompts=16, new_tokens=NEW_TOKENS, seed=1)
    counts = Counter(a.kind for a in schedule)
    total_weight = sum(k.weight for k in KINDS)
    for kind in KINDS:
        share = kind.weight / total_weight
        expected = share * len(schedule)
        assert abs(counts[kind.name] - expected) < 5 * (expected * (1 - share)) ** 0.5, kind.name


def test_prompts_and_token_budgets_stay_in_their_ranges():
    schedule = poisson_schedule(20.0, 100, KINDS, prompts=7, new_tokens=NEW_TOKENS, seed=2)
    assert {a.prompt for a in schedule} == set(range(7))
    assert all(NEW_TOKENS.low <= a.new_tokens <= NEW_TOKENS.high for a in schedule)


def test_the_rate_changes_when_requests_come_not_what_they_are():
    slow = poisson_schedule(2.0, 300, KINDS, prompts=16, new_tokens=NEW_TOKENS, seed=5)
    fast = poisson_schedule(8.0, 300, KINDS, prompts=16, new_tokens=NEW_TOKENS, seed=5)
    common = min(len(slow), len(fast))
    assert [(a.kind, a.prompt, a.new_tokens) for a in slow[:common]] == [
        (a.kind, a.prompt, a.new_tokens) for a in fast[:common]
    ]


def test_a_rate_must_be_positive():
    with pytest.raises(ValueError):
        poisson_schedule(0, 60, KINDS, prompts=4, new_tokens=NEW_TOKENS, seed=0)


def test_kinds_the_server_cannot_answer_are_left_out():
    names = {k.name for k in available_kinds(KINDS, lora=False, prefix=True, chat=False)}
    assert not {"grpc_lora", "openai_lora", "openai_chat", "openai_chat_stream"} & names
    assert {"grpc_prefix", "tgi_prefix", "grpc_unary"} <= names
    assert len(available_kinds(KINDS, lora=True, prefix=True, chat=True)) == len(KINDS)


def test_weights_replace_and_zero_removes():
    kinds = with_weights(KINDS, {"grpc_unary": 50, "tgi_prefix": 0})
    assert next(k for k in kinds if k.name == "grpc_unary").weight == 50
    names = {k.name for k in available_kinds(kinds, lora=True, prefix=True, chat=True)}
    assert "tgi_prefix" not in names and "grpc_unary" in names
    with pytest.raises(ValueError, match="unknown request kinds"):
        with_weights(KINDS, {"grpc_nonsense": 1})


@pytest.mark.parametrize(
    ("text", "expected"), [("a=1,b=0", {"a": 1.0, "b": 0.0}), (" a = 2.5 ,", {"a": 2.5}), ("", {})]
)
def test_weights_parse(text, expected):
    assert parse_weights(text) == expected


@pytest.mark.parametrize("text", ["a", "a=-1", "a=x"])
def test_bad_weights_are_refused(text):
    with pytest.raises(ValueError):
        parse_weights(text)


def test_an_empty_mix_is_refused():
    with pytest.raises(ValueError, match="no kinds"):
        next(draws([], random.Random(0), prompts=1, new_tokens=NEW_TOKENS))


def test_every_kind_has_a_sender_and_expects_its_success():
    assert set(SENDERS) == set(KIND_NAMES)
    for kind in KINDS:
        assert ("grpc:OK" if kind.transport == "grpc" else "http:200") in kind.expected


# ---- windows, drift, verdicts ------------------------------------------------------------------------


def test_windows_cover_the_run_and_the_last_may_be_short():
    assert bounds(120, 30) == [(0, 30), (30, 60), (60, 90), (90, 120)]
    assert bounds(100, 30)[-1] == (90, 100)
    assert bounds(20, 300) == [(0, 20)]
    with pytest.raises(ValueError):
        bounds(0, 30)


def test_requests_and_samples_fall_in_their_windows():
    records = [
        record("grpc_unary", 1, 2.0),
        record("grpc_stream", 5, 4.0, ttft=0.5),
        record("grpc_stream_cancel", 12, 1.0, "grpc:CANCELLED", ttft=0.25),
        record("grpc_unary", 19.5, 30.0),  # sent in the second window, answered long after the end
    ]
    samples = [
        sample(0, 100, 0),
        sample(5, 110, 12),
        sample(10, 105, 3),
        sample(15, 120, 7),
        sample(40, 118, 0),
    ]
    first, second = windows(records, samples, duration=20, length=10)
    assert (first.requests, second.requests) == (2, 2)
    assert (first.rss_start, first.rss_end, first.rss_max) == (100 * MIB, 110 * MIB, 110 * MIB)
    # The sample taken after the load stopped belongs to the last window.
    assert (second.rss_start, second.rss_end, second.rss_max) == (105 * MIB, 118 * MIB, 120 * MIB)
    assert (first.kv_used_max, second.kv_used_max, second.kv_used_end) == (12, 7, 0)
    assert second.codes == {"grpc:CANCELLED": 1, "grpc:OK": 1}
    assert first.requests_per_second == pytest.approx(0.2)
    assert first.tokens_per_second == pytest.approx(2.0)
    assert first.kinds["grpc_unary"].latency.p50 == pytest.approx(2.0)
    assert first.kinds["grpc_unary"].ttft is None
    assert first.kinds["grpc_stream"].ttft is not None and first.kinds["grpc_stream"].ttft.p99 == 0.5
    assert second.latency is not None and second.latency.p50 == pytest.approx(15.5)


def test_a_window_without_samples_has_no_rss():
    (only,) = windows([record("grpc_unary", 1, 1.0)], [sample(0, None)], duration=10, length=10)
    assert only.rss_start is None and only.rss_max is None and only.kv_used_max is None


def _rss_windows(ends: Sequence[float], peaks: Sequence[float] | None = None) -> list[Window]:
    samples = []
    for index, end in enumerate(ends):
        peak = (peaks or ends)[index]
        samples += [sample(index * 10 + 1, peak), sample(index * 10 + 9, end)]
    return windows([], samples, duration=10 * len(ends), length=10)


def test_drift_is_measured_from_the_end_of_the_first_window():
    # Warm-up growth in the first window (1000 → 1000 at its end) does not count; the rest is +3 %.
    drift, peak = rss_drift(_rss_windows([1000, 1010, 1020, 1030], peaks=[1200, 1010, 1060, 1030]))
    assert drift == pytest.approx(0.03)
    assert peak == pytest.approx(0.06)


def test_drift_needs_two_windows_with_rss():
    assert rss_drift(_rss_windows([1000])) == (None, None)
    assert rss_drift(windows([], [sample(1, None)], duration=20, length=10)) == (None, None)


@pytest.mark.parametrize(
    ("code", "server_error"),
    [
        ("grpc:INTERNAL", True),
        ("grpc:UNKNOWN", True),
        ("http:500", True),
        ("http:503", True),
        ("http:502:in-stream", True),
        ("grpc:CANCELLED", False),
        ("grpc:RESOURCE_EXHAUSTED", False),
        ("http:429", False),
        ("http:closed", False),
        ("client:ServerDisconnectedError", False),
    ],
)
def test_server_errors_are_internal_unknown_and_5xx(code, server_error):
    assert is_server_error(code) is server_error


def test_unexpected_outcomes_are_counted_by_kind_and_code():
    expected = {k.name: k.expected for k in KINDS}
    records = [
        record("grpc_stream_cancel", 0, 1, "grpc:CANCELLED"),
        record("grpc_deadline", 0, 1, "grpc:DEADLINE_EXCEEDED"),
        record("grpc_unary", 0, 1, "grpc:DEADLINE_EXCEEDED"),
        record("openai_stream_cancel", 0, 1, "http:closed"),
        record("tgi_generate", 0, 1, "http:500"),
        record("tgi_generate", 0, 1, "http:500"),
    ]
    assert unexpected(records, expected) == {
        "grpc_unary grpc:DEADLINE_EXCEEDED": 1,
        "tgi_generate http:500": 2,
    }


def verdicts(**changes: Any) -> Verdicts:
    base: dict[str, Any] = {
        "rss_drift": 0.01,
        "rss_peak_growth": 0.02,
        "server_exits": 0,
        "server_errors": 0,
        "unexpected": 0,
        "kv_used_at_end": 0,
        "kv_drain_seconds": 0.5,
    }
    return Verdicts(**{**base, **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"rss_drift": 0.051},
        {"rss_drift": -0.06},
        {"server_exits": 1},
        {"server_errors": 1},
        {"kv_used_at_end": 3},
    ],
)
def test_any_missed_target_fails_the_soak(changes):
    assert verdicts().passed
    assert not verdicts(**changes).passed


def test_what_was_not_measured_neither_passes_nor_fails():
    unmeasured = verdicts(rss_drift=None, server_exits=None, kv_used_at_end=None)
    assert unmeasured.passed
    assert [ok for _, _, ok in unmeasured.checks()] == [None, None, True, None]


# ---- monitor parsing ---------------------------------------------------------------------------------


def test_vm_rss_is_read_in_bytes():
    status = "Name:\tpython\nVmPeak:\t 2000 kB\nVmRSS:\t  1536 kB\nThreads:\t9\n"
    assert parse_vm_rss(status) == 1536 * 1024
    assert parse_vm_rss("Name:\tkthread\n") is None


def test_kv_blocks_and_failures_come_from_the_servers_exposition():
    metrics = Metrics(max_sequence_length=64, max_new_tokens=32, max_batch_size=4)
    assert kv_blocks(metrics.render().decode()) == (None, None)  # a padded engine sets no block gauge
    metrics.kv_cache_blocks.labels(state="total").set(1024)
    metrics.kv_cache_blocks.labels(state="used").set(37)
    metrics.kv_cache_blocks.labels(state="cached").set(120)
    metrics.request_failure.labels(err="cancelled").inc(4)
    metrics.request_failure.labels(err="validation").inc()
    text = metrics.render().decode()
    assert kv_blocks(text) == (37, 120)
    assert failure_counts(text) == {"cancelled": 4, "validation": 1}


SERVER_LOG = """\
2026-01-01 10:00:00,000 INFO tgis: starting
2026-01-01 10:00:01,000 ERROR aiohttp.server: Error handling request from 127.0.0.1
Traceback (most recent call last):
  File "x.py", line 1, in f
    raise ConnectionResetError("gone")
ConnectionResetError: gone

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "y.py", line 2, in g
aiohttp.client_exceptions.ClientConnectionResetError: Cannot write to closing transport request_id=ab12
2026-01-01 10:00:02,000 INFO tgis.requests: Generate failed request_id=cd34
2026-01-01 10:00:03,000 ERROR aiohttp.server: Error handling request from 127.0.0.1
Traceback (most recent call last):
aiohttp.client_exceptions.ClientConnectionResetError: Cannot write to closing transport request_id=ef56
2026-01-01 10:00:04,000 CRITICAL tgis: The batching loop crashed request_id=0f
"""


def test_server_log_errors_are_counted_by_message_and_final_exception():
    assert log_errors(SERVER_LOG) == {
        "aiohttp.server: Error handling request from 127.0.0.1 → "
        "aiohttp.client_exceptions.ClientConnectionResetError: Cannot write to closing transport": 2,
        "tgis: The batching loop crashed": 1,
    }
    assert log_errors("2026-01-01 10:00:00,000 INFO tgis: fine\n") == {}


# ---- load loops on fake senders ----------------------------------------------------------------------


def fake_send(zero: float, latency: float = 0.01, code: str = "grpc:OK") -> Send:
    async def send(arrival: Arrival) -> SoakRecord:
        started = time.perf_counter() - zero
        await asyncio.sleep(latency)
        return SoakRecord(arrival.kind, started, time.perf_counter() - zero, None, code, arrival.new_tokens)

    return send


def test_the_open_loop_sends_on_schedule_without_waiting_for_answers():
    schedule = [Arrival(i, 0.02 * i, "grpc_unary", 0, 5) for i in range(5)]

    async def run() -> tuple[list[SoakRecord], OpenLoop]:
        zero = time.perf_counter()
        loop = OpenLoop(fake_send(zero, latency=0.2), zero)
        return await loop.run(schedule, asyncio.Event()), loop

    records, loop = asyncio.run(run())
    assert len(records) == 5 and loop.sent == 5 and loop.in_flight == 0
    # Each 0.2 s request overlaps the next: all were sent before the first answer came.
    assert max(r.start for r in records) < min(r.end for r in records)
    assert [r.start for r in records] == sorted(r.start for r in records)
    assert records[-1].start == pytest.approx(0.08, abs=0.05)


def test_stopping_the_open_loop_sends_no_more():
    schedule = [Arrival(0, 0.0, "grpc_unary", 0, 5), Arrival(1, 5.0, "grpc_unary", 0, 5)]

    async def run() -> list[SoakRecord]:
        zero = time.perf_counter()
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        return await OpenLoop(fake_send(zero), zero).run(schedule, stop)

    started = time.perf_counter()
    assert len(asyncio.run(run())) == 1
    assert time.perf_counter() - started < 2


def test_saturation_counts_answers_after_the_first_third():
    records = [record("grpc_unary", 0, end, "grpc:OK") for end in (5, 15, 21, 25, 30, 31)]
    found = saturation(records, concurrency=4, seconds=30)
    assert found.requests == 4  # 5 is in the ramp up, 31 after the end
    assert found.requests_per_second == pytest.approx(4 / 20)
    assert found.tokens_per_second == pytest.approx(40 / 20)
    assert found.codes == {"grpc:OK": 4}


def test_the_probe_keeps_its_clients_busy_until_its_time_is_up():
    mix = draws(KINDS[:1], random.Random(0), prompts=1, new_tokens=NEW_TOKENS)

    async def run() -> Saturation:
        zero = time.perf_counter()
        return await probe_saturation(
            fake_send(zero, latency=0.02), mix, concurrency=3, seconds=0.3, zero=zero
        )

    found = asyncio.run(run())
    # 3 clients × 0.2 s counted / 0.02 s each: about 30 answers, fewer on a busy machine.
    assert 5 <= found.requests <= 33
    assert found.requests_per_second == pytest.approx(found.requests / 0.2)


def test_the_warm_up_refuses_a_kind_that_fails():
    kinds = ["grpc_unary", "grpc_stream_cancel"]
    expected = {k.name: k.expected for k in KINDS}

    async def answer(arrival: Arrival) -> SoakRecord:
        code = "grpc:CANCELLED" if arrival.kind == "grpc_stream_cancel" else "grpc:INVALID_ARGUMENT"
        return record(arrival.kind, 0, 0.1, code)

    with pytest.raises(SoakError, match="grpc_unary: grpc:INVALID_ARGUMENT"):
        asyncio.run(warm_up(answer, kinds, expected))

    async def fine(arrival: Arrival) -> SoakRecord:
        return record(arrival.kind, 0, 0.1, "grpc:CANCELLED" if "cancel" in arrival.kind else "grpc:OK")

    asyncio.run(warm_up(fine, kinds, expected))


# ---- HTTP bodies and SSE ----------------------------------------------------------------------------


def test_request_bodies():
    body = openai_body("m", 12, stream=True, prompt="hi")
    assert body["min_tokens"] == 12 and body["max_tokens"] == 12 and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True}
    guided = openai_body("m", 12, stream=False, exact=False, guided_choice=["a", "b"])
    assert "min_tokens" not in guided and "stream" not in guided and guided["guided_choice"] == ["a", "b"]
    assert tgi_body("hi", 5, adapter_id="p") == {
        "inputs": "hi",
        "parameters": {"max_new_tokens": 5, "details": True, "adapter_id": "p"},
    }


def test_in_stream_errors_keep_their_status():
    assert in_stream_status({"error": {"message": "x", "code": 503}}) == 503
    assert in_stream_status({"error": "x", "error_type": "overloaded"}) == 429
    assert in_stream_status({"error": "x", "error_type": "generation"}) == 500


def _sse(events: list[str]) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(f"data:{event}\n\n".encode())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/s", handler)
    return app


async def _read(events: list[str], form: StreamFormat, close_after: int | None = None) -> Answer:
    import aiohttp

    runner = web.AppRunner(_sse(events))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            return await post_stream(session, f"http://127.0.0.1:{port}/s", {}, form, close_after=close_after)
    finally:
        await runner.cleanup()


OPENAI_EVENTS = [
    json.dumps({"choices": [{"text": "a"}]}),
    json.dumps({"choices": [{"text": "b"}]}),
    json.dumps({"choices": [{"text": "c"}]}),
    json.dumps({"choices": [], "usage": {"completion_tokens": 4}}),
    "[DONE]",
]


def test_an_sse_answer_counts_tokens_and_its_first_one():
    answer = asyncio.run(_read(OPENAI_EVENTS, OPENAI_STREAM))
    assert (answer.code, answer.tokens) == ("http:200", 4)  # the usage chunk's count wins over the events
    assert answer.ttft is not None and answer.ttft > 0
    tgi = [json.dumps({"token": {"text": "x"}, "details": None}) for _ in range(2)]
    tgi.append(json.dumps({"token": {"text": "y"}, "details": {"generated_tokens": 3}}))
    assert asyncio.run(_read(tgi, TGI_STREAM)).tokens == 3


def test_a_chat_streams_role_chunk_is_not_its_first_token():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    content = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}
    done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    assert [OPENAI_STREAM.carries_token(e) for e in (role, content, done)] == [False, True, False]
    answer = asyncio.run(_read([json.dumps(e) for e in (role, content, content, done)], OPENAI_STREAM))
    assert (answer.code, answer.tokens) == ("http:200", 2)


def test_a_client_hang_up_and_an_in_stream_error_are_their_own_codes():
    closed = asyncio.run(_read(OPENAI_EVENTS, OPENAI_STREAM, close_after=2))
    assert (closed.code, closed.tokens) == ("http:closed", 2)
    failing = [OPENAI_EVENTS[0], json.dumps({"error": {"message": "boom", "code": 500}})]
    assert asyncio.run(_read(failing, OPENAI_STREAM)).code == "http:500:in-stream"


def test_a_malformed_answer_is_recorded_not_raised():
    async def not_json(request: web.Request) -> web.Response:
        return web.Response(text="<html>oops</html>", content_type="application/json")

    async def run() -> SoakRecord:
        app = web.Application()
        app.router.add_post("/generate", not_json)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        target = SoakTarget(grpc="127.0.0.1:1", http=f"http://127.0.0.1:{port}", model="m")
        try:
            async with SoakClient(target, ["hello"], time.perf_counter()) as client:
                return await client.send(Arrival(0, 0.0, "tgi_generate", 0, 4))
        finally:
            await runner.cleanup()

    answered = asyncio.run(run())
    assert answered.code == "client:malformed answer (JSONDecodeError)"
    assert answered.kind == "tgi_generate" and answered.end >= answered.start


# ---- report ------------------------------------------------------------------------------------------


def soak_results(passed: bool = True) -> SoakResults:
    records = [
        record("grpc_unary", 1, 2.0),
        record("grpc_stream_cancel", 3, 1.0, "grpc:CANCELLED", ttft=0.2),
        record("tgi_generate", 12, 1.5, "http:200" if passed else "http:500"),
    ]
    samples = [sample(0, 1000, 0), sample(9, 1000, 4), sample(19, 1010, 0)]
    series = windows(records, samples, 20, 10)
    drift, peak = rss_drift(series)
    return SoakResults(
        created="2026-01-01 00:00 UTC",
        machine=MachineInfo("Test CPU", 2, "2.13", 2, "5.0", "3.11", "Linux", cpu_flags="avx2 fma"),
        model=ModelShape(
            "bench-gpt2-small-v1", "gpt2", 12, 768, 12, 2048, 1024, 87_000_000, "bfloat16 on cpu"
        ),
        server={"how": "launched", "settings": {"MAX_BATCH_SIZE": "16"}, "rss": "VmRSS", "adapters": "two"},
        settings={
            "minutes": 20 / 60,
            "window_seconds": 10,
            "sample_seconds": 5,
            "load": 0.8,
            "prompt_tokens": "16:96",
            "new_tokens": "16:64",
            "prompts": 64,
            "seed": 0,
            "time_limit_ms": 500,
            "deadline_ms": 800,
            "request_timeout": 300,
            "drain_seconds": 30,
            "chat": True,
        },
        mix=[
            MixEntry("grpc_unary", "grpc", 3, ["grpc:OK"]),
            MixEntry("tgi_generate", "http", 1, ["http:200"]),
        ],
        saturation=saturation(records, 32, 30),
        rate=0.15,
        seconds=20,
        requests=len(records),
        windows=series,
        kinds={},
        codes=dict(Counter(r.code for r in records)),
        unexpected=unexpected(records, {k.name: k.expected for k in KINDS}),
        server_failures={"cancelled": 1, "timeout": 0},
        server_log_errors={} if passed else {"aiohttp.server: Error handling request → X: y": 2},
        verdicts=verdicts(rss_drift=drift, rss_peak_growth=peak, server_errors=0 if passed else 1),
        samples=samples,
    )


def test_the_report_shows_windows_verdicts_and_failures():
    text = render_markdown(soak_results())
    assert "| RSS drift after the first window < 5% | +1.00% | pass |" in text
    assert "| 0–10 | 2 | 0.20 |" in text and "| 10–20 | 1 | 0.10 |" in text
    assert "1000 / 1000 / 1000" in text and "1010 / 1010 / 1010" in text  # RSS start / end / max, MiB
    assert "grpc:CANCELLED × 1" in text
    assert "**Overall: PASS**" in text
    assert "`cancelled` × 1" in text and "`timeout`" not in text
    assert "ERROR lines in the server's log (warm-up and probe included): none." in text
    assert "| CPU flags | avx2 fma |" in text and "| torch | 2.13 (client process: 2 threads) |" in text
    failed = render_markdown(soak_results(passed=False))
    assert "| INTERNAL / UNKNOWN / 5xx = 0 | 1 | **FAIL** |" in failed
    assert "**Overall: FAIL**" in failed
    assert "`tgi_generate http:500` × 1" in failed
    assert "`aiohttp.server: Error handling request → X: y` × 2" in failed


def test_the_json_has_every_field_and_the_verdicts(tmp_path: Path):
    paths = write_report(soak_results(), tmp_path)
    assert sorted(p.name for p in paths) == ["REPORT.md", "results.json"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["verdicts"]["passed"] is True
    assert [c["passed"] for c in data["verdicts"]["checks"]] == [True, True, True, True]
    assert data["windows"][1]["rss_end"] == 1010 * MIB
    assert data["saturation"]["concurrency"] == 32
    assert [s["rss_bytes"] for s in data["samples"]] == [1000 * MIB, 1000 * MIB, 1010 * MIB]
    assert data == to_json(soak_results()) | {"created": data["created"]}


def test_failures_list_only_abnormal_ends():
    assert failures_cell({"grpc:OK": 5, "http:200": 3}) == "none"
    assert failures_cell({"grpc:OK": 5, "grpc:CANCELLED": 2, "http:closed": 1}) == (
        "grpc:CANCELLED × 2, http:closed × 1"
    )


# ---- flags -------------------------------------------------------------------------------------------


def test_flags_make_a_config():
    args = parser().parse_args(
        [
            "--minutes",
            "2",
            "--window",
            "30",
            "--mix",
            "grpc_unary=3,tgi_prefix=0",
            "--server-env",
            "DTYPE=float32",
        ]
    )
    config = config_from(args)
    assert config.seconds == 120 and config.window_seconds == 30 and config.external is None
    assert config.weights == {"grpc_unary": 3.0, "tgi_prefix": 0.0}
    assert config.launch.described()["DTYPE"] == "float32"
    external = config_from(
        parser().parse_args(
            ["--minutes", "1", "--server", "h:1", "--http-url", "http://h:2", "--server-pid", "7"]
        )
    )
    assert external.external is not None and external.external.pid == 7 and external.external.lora is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--minutes", "0"],
        ["--minutes", "1", "--mix", "nonsense=1"],
        ["--minutes", "1", "--server-env", "NOVALUE"],
    ],
)
def test_bad_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        parser().parse_args(argv)


def test_an_external_server_needs_its_http_port():
    with pytest.raises(SystemExit, match="--http-url"):
        config_from(parser().parse_args(["--minutes", "1", "--server", "h:1"]))


def test_kind_specs_are_unique():
    names = [k.name for k in KINDS]
    assert len(names) == len(set(names))
    assert all(isinstance(k, KindSpec) and k.weight > 0 for k in KINDS)
