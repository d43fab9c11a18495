"""The GPU benchmark's tooling on the CPU: the llama-tiny benchmark model built from scratch (its 32k
tokenizer too), served, swept, set against the weights-bandwidth bound, the compiled-family baselines and
the decode floor; figures are checked for consistency, not timed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.integration.harness import ServerThread
from tgis_bench.baselines.common import ALL_BASELINES
from tgis_bench.load.run import BenchmarkConfig, run_benchmark
from tgis_bench.load.workload import LengthRange, WorkloadSpec
from tgis_bench.models.build import ensure_bench_model
from tgis_bench.reports.benchmark import render_markdown, write_report

pytestmark = pytest.mark.slow  # trains the 32k tokenizer and builds the model: about 10 s

WORKLOAD = WorkloadSpec(requests=4, prompt_tokens=LengthRange(16, 16), new_tokens=LengthRange(4, 4), seed=1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_bench_model(tmp_path_factory.mktemp("bench-cache"), shape="llama-tiny")


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerThread]:
    server = ServerThread(tiny_llama, max_batch_size=2)
    yield server
    server.stop()


def test_the_tiny_llama_is_built_once_in_bfloat16_with_the_32k_tokenizer(tiny_llama: Path):
    assert tiny_llama.name == "bench-llama-tiny-v1"
    with safe_open(str(tiny_llama / "model.safetensors"), framework="pt") as weights:
        head = weights.get_slice("lm_head.weight")
        assert head.get_shape() == [32000, 256] and head.get_dtype() == "BF16"
    assert ensure_bench_model(tiny_llama.parent, shape="llama-tiny") == tiny_llama  # cached, not rebuilt


def test_a_gpu_style_run_on_the_cpu_reports_the_bound_baselines_and_floor(server, tiny_llama, tmp_path):
    config = BenchmarkConfig(
        server=f"localhost:{server.server.grpc_port}",
        model_dir=tiny_llama,
        workload=WORKLOAD,
        concurrency=(1, 2),
        metrics_url=f"http://127.0.0.1:{server.server.http_port}/metrics",
        baselines=ALL_BASELINES,
        progress=False,
        dtype="float32",
        requests_per_client=1,
        floor_batches=(1, 2),
        floor_prompt_tokens=16,
        floor_steps=3,
        regenerate="make gpu-benchmark-report",
    )
    results = run_benchmark(config)
    assert [(run.concurrency, run.requests, run.short_requests) for run in results.runs] == [
        (1, 1, 0),
        (2, 2, 0),
    ]
    assert results.model.model_type == "llama" and results.model.kv_heads == 2
    bound = results.bound
    assert bound is not None and bound.bandwidth.timer == "time.perf_counter"
    assert results.model.parameters == bound.weights.parameters  # safetensors headers, meta-device model
    assert bound.weights.bytes_per_step == 4 * (bound.weights.parameters - 32000 * 256)  # float32, no embed
    assert [(b.name, b.batch_size, b.tokens) for b in results.baselines] == [
        (name, 2 if "batched" in name else 1, 4 * (2 if "batched" in name else 1)) for name in ALL_BASELINES
    ]
    assert [f.batch_size for f in results.decode_floor] == [1, 2] and results.baseline_failures == []
    text = render_markdown(results)
    assert "## Weights-bandwidth bound" in text and "× the bound.**" in text
    assert "## Torch-alone decode step" in text and "`make gpu-benchmark-report`" in text
    assert all(path.stat().st_size > 0 for path in write_report(results, tmp_path))
