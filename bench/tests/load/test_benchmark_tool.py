"""The benchmark tool end to end against a real server on a tiny model (figures are checked, not timed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from transformers import AutoTokenizer

from tests.integration.harness import ServerThread
from tgis_bench.compare.paired import main as paired_main
from tgis_bench.load.client import run_load
from tgis_bench.load.run import BenchmarkConfig, run_benchmark
from tgis_bench.load.workload import LengthRange, WorkloadSpec, build_workload
from tgis_bench.reports.benchmark import render_markdown, write_report

WORKLOAD = WorkloadSpec(requests=4, prompt_tokens=LengthRange(4, 12), new_tokens=LengthRange(3, 6), seed=5)


@pytest.fixture(scope="module")
def server(model_dirs) -> Iterator[ServerThread]:
    server = ServerThread(model_dirs("gpt2"), max_batch_size=4)
    yield server
    server.stop()


def _target(server: ServerThread) -> str:
    return f"localhost:{server.server.grpc_port}"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_every_request_gets_exactly_its_tokens_from_its_exact_prompt(server, model_dirs, stream):
    requests = build_workload(AutoTokenizer.from_pretrained(model_dirs("gpt2")), WORKLOAD)
    run = asyncio.run(run_load(_target(server), requests, concurrency=2, stream=stream, progress=False))
    assert [t.index for t in run.requests] == [r.index for r in requests]
    for timing, request in zip(run.requests, requests, strict=True):
        assert timing.input_tokens == len(request.input_ids)
        assert timing.generated_tokens == timing.asked_tokens == request.max_new_tokens
        assert timing.stop_reason == "MAX_TOKENS"
        assert 0 < timing.latency <= run.seconds
        if stream:
            assert timing.ttft is not None and 0 < timing.ttft <= timing.latency
            assert len(timing.inter_token) == request.max_new_tokens - 1
            assert timing.ttft + sum(timing.inter_token) <= timing.latency
        else:
            assert timing.ttft is None and timing.inter_token == ()


def test_a_benchmark_run_reports_throughput_latency_steps_and_ratios(server, model_dirs, tmp_path):
    config = BenchmarkConfig(
        server=_target(server),
        model_dir=model_dirs("gpt2"),
        workload=WORKLOAD,
        concurrency=(1, 2),
        metrics_url=f"http://127.0.0.1:{server.server.http_port}/metrics",
        batch_size=2,
        progress=False,
    )
    results = run_benchmark(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dirs("gpt2"))
    asked = sum(r.max_new_tokens for r in build_workload(tokenizer, WORKLOAD))
    assert results.workload.new_token_total == asked
    assert [run.concurrency for run in results.runs] == [1, 2]
    for run in results.runs:
        assert run.requests == 4 and run.short_requests == 0
        assert run.generated_tokens == run.asked_tokens == asked
        assert run.tokens_per_second > 0
        assert run.ttft is not None and run.inter_token is not None
        # Each request's TTFT is at most its latency, so every order statistic is too.
        assert run.ttft.p50 <= run.latency.p50 and run.ttft.p99 <= run.latency.p99
        next_token = run.steps["next_token"]
        assert next_token.steps > 0 and 0 < next_token.tokproc_share < 1
        assert next_token.mean_batch_size is not None and 1 <= next_token.mean_batch_size <= run.concurrency
        assert run.steps["prefill"].steps >= 1
    assert [(b.name, b.batch_size, b.tokens) for b in results.baselines] == [
        ("sequential", 1, asked),
        ("batched", 2, asked),
    ]
    assert all(b.tokens_per_second > 0 for b in results.baselines)
    ratios = results.ratios()
    assert set(ratios) == {"sequential", "batched"} and all(r > 0 for r in ratios.values())
    assert results.server["max_sequence_length"] > 0 and results.model.model_type == "gpt2"
    text = render_markdown(results)
    assert "server / sequential generate():" in text and "server / raw batched decode loop (batch 2):" in text
    assert all(path.stat().st_size > 0 for path in write_report(results, tmp_path))


def test_paired_rounds_drive_every_configuration_each_round_in_alternating_order(
    server, model_dirs, tmp_path
):
    """One server under two names: every round reaches both, in turn, with the same fresh prompts."""
    address = _target(server)
    metrics = f"http://127.0.0.1:{server.server.http_port}/metrics"
    argv = ["--server", f"a={address},{metrics}", "--server", f"b={address}", "--model-dir"]
    argv += [str(model_dirs("gpt2")), "--rounds", "3", "--concurrency", "1,2", "--requests", "4"]
    argv += ["--prompt-tokens", "4:12", "--new-tokens", "3:6", "--out", str(tmp_path)]
    assert paired_main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    order = [(s["round"], s["concurrency"], s["name"]) for s in data["samples"]]
    assert order == [
        (r, c, name) for r in range(3) for c in (1, 2) for name in (("a", "b") if r % 2 == 0 else ("b", "a"))
    ]
    assert all(s["tokens_per_second"] > 0 and s["speculation"] is None for s in data["samples"])
    assert [(s["name"], s["concurrency"], s["rounds"]) for s in data["summaries"]] == [
        ("b", 1, 3),
        ("b", 2, 3),
    ]
    assert all(s["low"] <= s["median"] <= s["high"] for s in data["summaries"])
    assert "| 2 | b | 3 |" in (tmp_path / "REPORT.md").read_text()
