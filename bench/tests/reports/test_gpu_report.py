"""A GPU benchmark's report from fabricated results: machine facts, the bound and its ratios, the compiled
baselines, the decode floor, the long-prompt workload; and the flags that ask for them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tgis_bench.baselines.bound import CopyBandwidth, DecodeBound, WeightTraffic
from tgis_bench.baselines.common import BaselineResult
from tgis_bench.baselines.decode_floor import DecodeFloorResult
from tgis_bench.load.cli import benchmark_config, parser
from tgis_bench.load.client import LoadRun, RequestTiming
from tgis_bench.load.metrics import StepShare
from tgis_bench.load.results import BenchmarkResults, ModelShape, WorkloadInfo, to_json
from tgis_bench.load.stats import Percentiles, summarize
from tgis_bench.machine import MachineInfo
from tgis_bench.reports.benchmark import console_report, render_markdown, write_report

# 2.0 GB a step; a 1 GiB copy in 1 ms at best moves 2 GiB: about 2147 GB/s, so about 0.931 ms a step.
BOUND = DecodeBound(
    WeightTraffic(1_100_048_384, 1_000_000_000, ("model.embed_tokens.weight",), 2),
    CopyBandwidth("cuda:0 (Test GPU)", 1 << 30, (0.0011, 0.001, 0.0012), "CUDA events"),
)
STEP = BOUND.step_seconds


def _run(concurrency: int, seconds: float, gap: float) -> LoadRun:
    timings = tuple(RequestTiming(i, 128, 9, 9, "MAX_TOKENS", 1.0, 0.02, (gap,) * 8) for i in range(4))
    return LoadRun(concurrency, True, seconds, timings)


def _results() -> BenchmarkResults:
    steps = {"next_token": StepShare("next_token", 100, 0.27, 0.03, 16.0)}  # 3 ms a step
    return BenchmarkResults(
        created="2026-01-01 00:00 UTC",
        machine=MachineInfo(
            "Test CPU",
            16,
            "2.11.0+cu130",
            16,
            "5.24.0",
            "3.12.3",
            "Linux",
            gpu="Test GPU (80 GiB)",
            cuda="13.0",
        ),
        model=ModelShape(
            "bench-llama-1b-v1", "llama", 22, 2048, 32, 32000, 2048, 1_100_048_384, "bfloat16", 4, 5632
        ),
        workload=WorkloadInfo(
            8,
            "128:128",
            "9:9",
            0,
            True,
            1024,
            72,
            "abcd",
            requests_per_client=4,
            long_prompt_every=4,
            long_prompt_words=400,
            long_prompt_tokens="401:405",
        ),
        runs=[summarize(_run(1, 18.0, gap=2 * STEP)), summarize(_run(16, 0.9, gap=0.004), steps)],
        baselines=[
            BaselineResult("sequential", 1, 36, 1.8),
            BaselineResult(
                "compiled-batched", 16, 36, 0.6, "torch.compile mode=reduce-overhead (CUDA graphs)"
            ),
        ],
        bound=BOUND,
        decode_floor=[DecodeFloorResult(16, 128, 64, Percentiles(0.002, 0.0021, 0.0025), "CUDA events", "n")],
        baseline_failures=[
            "sequential generate(), static cache + torch.compile: failed (RuntimeError: boom)"
        ],
        regenerate="make gpu-benchmark-report",
    )


def test_the_machine_section_names_the_gpu_its_driver_and_cuda():
    text = render_markdown(_results())
    assert "| GPU | Test GPU (80 GiB) |" in text and "| CUDA (torch's) | 13.0 |" in text
    assert "| GPU driver | unknown |" in text  # none was found
    with_driver = dataclasses.replace(_results().machine, gpu_driver="580.159.04")
    assert "| GPU driver | 580.159.04 |" in render_markdown(
        dataclasses.replace(_results(), machine=with_driver)
    )
    assert "`make gpu-benchmark-report` regenerates this directory" in text
    assert "MLP width 5632, 32 heads (4 key/value heads)" in text


def test_the_bound_section_states_its_measurement_and_the_decode_step_ratio():
    text = render_markdown(_results())
    assert "1000.0M of the model's 1100.0M parameters, 2.000 GB in bfloat16" in text
    assert "(`model.embed_tokens.weight`)" in text
    assert (
        "a copy of 1.00 GiB on cuda:0 (Test GPU), 3 times after a warm-up, each timed with CUDA events"
        in text
    )
    assert f"moved **{2 * (1 << 30) / 0.001 / 1e9:.1f} GB/s**" in text
    assert f"**Bound: {STEP * 1000:.3f} ms per decode step**" in text
    assert f"(ITL p50 at concurrency 1): {2 * STEP * 1000:.1f} ms, 2.00× the bound.**" in text
    # Concurrency 16: 36 tokens in 0.9 s = 40 tokens/s against 16 per bound step.
    bound_16 = 16 / STEP
    assert f"| 16 | 40.0 | {bound_16:.0f} | {40 / bound_16:.1%} | 4.0 | {0.004 / STEP:.2f}× | 3.0 |" in text


def test_the_baselines_show_how_they_ran_and_what_failed():
    text = render_markdown(_results())
    assert (
        "| batched generate(), static cache + torch.compile | 16 | 60.0 | 0.6 "
        "| torch.compile mode=reduce-overhead (CUDA graphs) |"
    ) in text
    assert "- sequential generate(), static cache + torch.compile: failed (RuntimeError: boom)" in text
    assert "server / batched generate(), static cache + torch.compile (batch 16): 0.67x" in text


def test_the_floor_is_set_beside_the_servers_itl_at_that_concurrency():
    text = render_markdown(_results())
    assert (
        "## Torch-alone decode step" in text and "After 128-token prompts, 4 untimed steps, then 64" in text
    )
    assert "| 16 | 2.0 | 2.1 | 2.5 | 8000.0 | 4.0 | 2.00× |" in text
    assert "torch-alone decode step at batch 16: 2.0 ms" in console_report(_results())


def test_the_workload_states_the_long_prompts_and_the_requests_per_client():
    text = render_markdown(_results())
    assert (
        "prompts of 128–128 tokens, every 4th request's instead a window of 400 words of the same text "
        "(401–405 tokens; 1024 in all), 9–9 new tokens each"
    ) in text
    assert "4 requests each (the first 4 × c of the workload)" in text


def test_the_console_and_json_carry_the_bound(tmp_path: Path):
    results = _results()
    assert "decode step (ITL p50 at concurrency 1) 2.00× the bound" in console_report(results)
    write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data == json.loads(json.dumps(to_json(results)))
    assert data["bound"]["step_seconds"] == pytest.approx(STEP)
    assert data["bound"]["weights"]["bytes_per_parameter"] == 2
    assert data["bound"]["decode_step_ratio"] == pytest.approx(2.0)
    assert [row["concurrency"] for row in data["bound"]["rows"]] == [1, 16]
    assert data["decode_floor"][0]["tokens_per_second"] == pytest.approx(8000.0)
    assert data["machine"]["cuda"] == "13.0" and data["regenerate"] == "make gpu-benchmark-report"


def test_a_report_without_the_bound_or_floor_has_neither_section():
    results = dataclasses.replace(_results(), bound=None, decode_floor=[])
    text = render_markdown(results)
    assert "Weights-bandwidth bound" not in text and "Torch-alone" not in text
    assert "bound" not in console_report(results)


def test_the_gpu_flags_make_the_config(tmp_path: Path):
    p = parser()
    args = p.parse_args(
        ["--model-dir", str(tmp_path), "--dtype", "bfloat16", "--requests-per-client", "4",
         "--baselines", "compiled,sequential,compiled-batched", "--decode-floor", "1,16,64",
         "--decode-floor-steps", "16", "--long-prompt-every", "4", "--no-bound", "--compile-cpu"]
    )  # fmt: skip
    config = benchmark_config(p, args)
    assert config.baselines == ("sequential", "compiled", "compiled-batched")  # in the order they run
    assert (
        config.floor_batches == (1, 16, 64) and config.floor_steps == 16 and config.floor_prompt_tokens == 128
    )
    assert config.requests_per_client == 4 and not config.measure_bound and config.compile_cpu
    assert config.workload.long_prompt_every == 4 and config.workload.long_prompt_words == 400
    assert config.regenerate == "make benchmark-report"


def test_the_served_model_is_a_directory_or_a_shape_never_both(tmp_path: Path, capsys):
    assert parser().parse_args(["--model-shape", "llama-tiny"]).model_shape == "llama-tiny"
    for argv in (["--model-dir", str(tmp_path), "--model-shape", "llama-1b"], [], ["--model-shape", "x"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
    p = parser()
    args = p.parse_args(
        ["--model-dir", str(tmp_path), "--long-prompt-every", "4", "--shared-prefix-tokens", "8"]
    )
    with pytest.raises(SystemExit):
        benchmark_config(p, args)
    assert "either a shared prefix or long prompts" in capsys.readouterr().err
