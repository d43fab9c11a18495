"""The benchmark tool without a server: workload, aggregation, metrics deltas, report rendering."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from tgis.metrics import Metrics
from tgis_bench.baselines.common import BaselineResult
from tgis_bench.load.cli import _baselines, _levels, parser
from tgis_bench.load.client import LoadRun, RequestTiming
from tgis_bench.load.metrics import (
    SpeculationShare,
    StepShare,
    histogram_totals,
    speculation_share,
    step_shares,
)
from tgis_bench.load.results import (
    BenchmarkResults,
    ModelShape,
    PeerResult,
    WorkloadInfo,
    to_json,
    workload_info,
)
from tgis_bench.load.stats import Percentiles, percentile, summarize
from tgis_bench.load.workload import (
    WARMUP_NEW_TOKENS,
    BenchRequest,
    LengthRange,
    WorkloadSpec,
    build_sweep,
    build_workload,
    fingerprint,
    fresh_prompts,
)
from tgis_bench.machine import MachineInfo, cpu_flags
from tgis_bench.reports.benchmark import (
    console_report,
    lone_stream_lines,
    render_markdown,
    speculation_lines,
    write_report,
)

SPEC = WorkloadSpec(requests=12, prompt_tokens=LengthRange(5, 40), new_tokens=LengthRange(3, 9), seed=7)
LONG_PROMPT_MIX = dataclasses.replace(SPEC, long_prompt_every=4, long_prompt_words=400)


# ---- workload ----------------------------------------------------------------------------------------


def test_the_same_spec_gives_the_same_requests(tokenizer):
    first, second = build_workload(tokenizer, SPEC), build_workload(tokenizer, SPEC)
    assert first == second
    assert fingerprint(first) == fingerprint(second)


def test_another_seed_gives_other_requests(tokenizer):
    other = build_workload(tokenizer, WorkloadSpec(12, SPEC.prompt_tokens, SPEC.new_tokens, seed=8))
    assert fingerprint(other) != fingerprint(build_workload(tokenizer, SPEC))


def test_prompts_can_be_cut_from_a_given_text(tokenizer):
    text = " ".join(f"word{i % 50} token{i % 7}" for i in range(3000))
    spec = WorkloadSpec(
        8, LengthRange(10, 20), LengthRange(3, 4), seed=2, prompt_text=text, prompt_source="t.txt"
    )
    requests = build_workload(tokenizer, spec)
    assert [len(r.input_ids) for r in requests] == [len(tokenizer(r.text)["input_ids"]) for r in requests]
    for request in requests:
        assert 10 <= len(request.input_ids) <= 20 and request.text.strip() in text
    assert build_workload(tokenizer, spec) == requests
    assert fingerprint(requests) != fingerprint(
        build_workload(tokenizer, dataclasses.replace(spec, prompt_text=""))
    )
    assert "cut from the words of `t.txt`" in render_markdown(
        dataclasses.replace(_results(), workload=workload_info(spec, requests, stream=True))
    )


def test_grounded_prompts_end_by_repeating_their_first_fifth(tokenizer):
    spec = WorkloadSpec(8, LengthRange(20, 40), LengthRange(3, 4), seed=3, grounded=True)
    requests = build_workload(tokenizer, spec)
    added = len(tokenizer("the")["input_ids"]) - len(tokenizer("the", add_special_tokens=False)["input_ids"])
    for request in requests:
        assert 20 <= len(request.input_ids) <= 40
        body = list(tokenizer(request.text, add_special_tokens=False)["input_ids"])
        repeated = len(body) // 5
        assert repeated >= 4 and body[-repeated:] == body[:repeated]
        assert len(body) + added == len(request.input_ids)
    assert "input-grounded" in render_markdown(
        dataclasses.replace(_results(), workload=workload_info(spec, requests, stream=True))
    )
    with pytest.raises(ValueError, match="shared prefix or grounded"):
        WorkloadSpec(8, LengthRange(20, 40), LengthRange(3, 4), shared_prefix_tokens=8, grounded=True)


def test_lengths_fall_in_their_ranges_and_vary(tokenizer):
    requests = build_workload(tokenizer, WorkloadSpec(40, LengthRange(5, 40), LengthRange(3, 9), seed=1))
    prompt_lengths = [len(r.input_ids) for r in requests]
    new_tokens = [r.max_new_tokens for r in requests]
    assert all(5 <= n <= 40 for n in prompt_lengths) and len(set(prompt_lengths)) > 5
    assert all(3 <= n <= 9 for n in new_tokens) and len(set(new_tokens)) > 3
    assert [r.index for r in requests] == list(range(40))


@pytest.mark.parametrize(
    "spec",
    [SPEC, LONG_PROMPT_MIX, dataclasses.replace(SPEC, grounded=True)],
    ids=["short", "long", "grounded"],
)
@pytest.mark.parametrize("which", ["tokenizer", "llama_tokenizer"])
def test_the_server_tokenizes_each_prompt_to_exactly_its_ids(which, spec, request):
    tok = request.getfixturevalue(which)
    for bench_request in build_workload(tok, spec):
        # What the server's tokenizer adapter does with the text (special tokens included).
        assert tuple(tok(bench_request.text, add_special_tokens=True)["input_ids"]) == bench_request.input_ids


SHARED_PREFIX = WorkloadSpec(10, LengthRange(8, 30), LengthRange(2, 5), seed=3, shared_prefix_tokens=24)


@pytest.mark.parametrize(
    "spec",
    [SPEC, LONG_PROMPT_MIX, dataclasses.replace(SPEC, grounded=True), SHARED_PREFIX],
    ids=["short", "long", "grounded", "shared-prefix"],
)
@pytest.mark.parametrize("which", ["tokenizer", "llama_tokenizer"])
def test_fresh_prompts_are_as_much_work_and_share_no_prefix_but_the_workloads(which, spec, request):
    """Same indices, prompt lengths (in tokens; a long prompt's in words, as the spec gives it) and
    budgets; prompts the server tokenizes to their ids; with a shared prefix, exactly that prefix (text
    and ids); past it, nothing a prefix cache keeps (not even the first 4 tokens)."""
    tok = request.getfixturevalue(which)
    requests = build_workload(tok, spec)
    fresh = fresh_prompts(tok, spec, requests, "level-1")

    def size(r: BenchRequest) -> tuple[int, int, int]:
        return r.index, len(r.text.split()) if spec.is_long(r.index) else len(r.input_ids), r.max_new_tokens

    assert [size(r) for r in fresh] == [size(r) for r in requests]
    kept = spec.shared_prefix_tokens + (1 if which == "llama_tokenizer" else 0)  # a BOS too
    for old, new in zip(requests, fresh, strict=True):
        assert tuple(tok(new.text, add_special_tokens=True)["input_ids"]) == new.input_ids
        assert new.input_ids[: spec.shared_prefix_tokens] == old.input_ids[: spec.shared_prefix_tokens]
        assert new.input_ids[: kept + 4] != old.input_ids[: kept + 4]
    if spec.shared_prefix_tokens:  # the text every prompt starts with, which holds the shared prefix
        shared_text = requests[0].text
        for other in requests[1:]:
            while not other.text.startswith(shared_text):
                shared_text = shared_text[:-1]
        assert len(shared_text) > 20 and all(r.text.startswith(shared_text) for r in fresh)
    assert fresh == fresh_prompts(tok, spec, requests, "level-1")  # seeded
    assert fresh != fresh_prompts(tok, spec, requests, "level-2")


def test_a_sweep_sends_the_workload_first_then_fresh_prompts_at_each_level(tokenizer):
    requests = build_workload(tokenizer, SPEC)
    sweep = build_sweep(tokenizer, SPEC, requests, (1, 2, 4), warmup=3, per_client=2)
    assert [(size, len(sent)) for size, sent in sweep.levels] == [(1, 2), (2, 4), (4, 8)]
    first, second, third = (sent for _, sent in sweep.levels)
    assert first == tuple(requests[:2])  # the first level's requests are the workload's, as before
    assert second == tuple(fresh_prompts(tokenizer, SPEC, requests[:4], "level-1"))
    assert third == tuple(fresh_prompts(tokenizer, SPEC, requests[:8], "level-2"))
    assert len(sweep.warmup) == 3 and all(r.max_new_tokens <= WARMUP_NEW_TOKENS for r in sweep.warmup)
    prompts = [r.input_ids for r in (*sweep.warmup, *sweep.timed)]
    assert len(set(prompts)) == len(prompts)  # no prompt is sent twice
    assert sweep.timed == [*first, *second, *third]
    assert build_sweep(tokenizer, SPEC, requests, (1, 2, 4), warmup=3, per_client=2) == sweep
    # The results' fingerprint covers what every level sent, and the report says levels had their own.
    info = workload_info(SPEC, requests, stream=True, per_client=2, timed=sweep.timed)
    assert info.fresh_levels and info.fingerprint == fingerprint(sweep.timed) != fingerprint(requests)
    assert "sends prompts of its own, as long" in render_markdown(
        dataclasses.replace(_results(), workload=info)
    )
    before = workload_info(SPEC, requests, stream=True)  # as results made before sweeps read back
    assert not before.fresh_levels
    assert "prompts of its own" not in render_markdown(dataclasses.replace(_results(), workload=before))


def test_llama_style_prompts_count_their_bos_in_the_length(llama_tokenizer):
    requests = build_workload(llama_tokenizer, SPEC)
    assert all(r.input_ids[0] == llama_tokenizer.bos_token_id for r in requests)
    assert all(5 <= len(r.input_ids) <= 40 for r in requests)


@pytest.mark.parametrize(("text", "expected"), [("16:128", (16, 128)), ("64", (64, 64)), ("3:3", (3, 3))])
def test_length_ranges_parse(text, expected):
    parsed = LengthRange.parse(text)
    assert (parsed.low, parsed.high) == expected
    assert LengthRange.parse(str(parsed)) == parsed


@pytest.mark.parametrize("text", ["0:4", "9:2", "x"])
def test_bad_length_ranges_are_refused(text):
    with pytest.raises(ValueError):
        LengthRange.parse(text)


# ---- aggregation -------------------------------------------------------------------------------------


def test_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(10, 0, -1)]  # unordered input
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([3.0], 99) == 3.0


def test_percentiles_match_numpy_on_random_samples():
    rng = random.Random(3)
    for size in (2, 7, 100):
        values = [rng.expovariate(20.0) for _ in range(size)]
        for q in (50, 90, 99):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentiles_refuse_nothing_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert Percentiles.of([]) is None


def _timing(index: int, *, asked: int, generated: int, latency: float, ttft: float | None) -> RequestTiming:
    gaps = () if ttft is None else tuple([(latency - ttft) / max(generated - 1, 1)] * (generated - 1))
    return RequestTiming(index, 10, asked, generated, "MAX_TOKENS", latency, ttft, gaps)


def test_summary_counts_every_token_over_the_wall_time():
    run = LoadRun(
        concurrency=2,
        stream=True,
        seconds=2.0,
        requests=(
            _timing(0, asked=5, generated=5, latency=1.0, ttft=0.2),
            _timing(1, asked=11, generated=11, latency=1.5, ttft=0.5),
        ),
    )
    summary = summarize(run)
    assert summary.generated_tokens == summary.asked_tokens == 16
    assert summary.tokens_per_second == pytest.approx(8.0)
    assert summary.requests_per_second == pytest.approx(1.0)
    assert summary.ttft is not None and summary.ttft.p50 == pytest.approx(0.35)
    # 4 gaps of 0.2 s and 10 gaps of 0.1 s.
    assert summary.inter_token is not None and summary.inter_token.p50 == pytest.approx(0.1)
    assert summary.inter_token.p99 == pytest.approx(0.2)
    assert summary.latency.p90 == pytest.approx(1.45)
    assert summary.short_requests == 0 and summary.steps == {}


def test_unary_summaries_have_no_token_timings_and_count_short_requests():
    run = LoadRun(1, False, 1.0, (_timing(0, asked=8, generated=6, latency=1.0, ttft=None),))
    summary = summarize(run)
    assert summary.ttft is None and summary.inter_token is None
    assert summary.short_requests == 1 and summary.generated_tokens == 6


# ---- server metrics ----------------------------------------------------------------------------------

SCRAPE_BEFORE = """\
# TYPE tgi_batch_inference_forward_duration histogram
tgi_batch_inference_forward_duration_sum{method="next_token",makeup="single_only"} 1.5
tgi_batch_inference_forward_duration_count{method="next_token",makeup="single_only"} 10.0
tgi_batch_inference_forward_duration_sum{method="prefill",makeup="single_only"} 0.5
tgi_batch_inference_forward_duration_count{method="prefill",makeup="single_only"} 2.0
# TYPE tgi_batch_inference_tokproc_duration histogram
tgi_batch_inference_tokproc_duration_sum{method="next_token",makeup="single_only"} 0.25
tgi_batch_inference_tokproc_duration_count{method="next_token",makeup="single_only"} 10.0
tgi_batch_inference_tokproc_duration_sum{method="prefill",makeup="single_only"} 0.1
tgi_batch_inference_tokproc_duration_count{method="prefill",makeup="single_only"} 2.0
# TYPE tgi_batch_inference_batch_size histogram
tgi_batch_inference_batch_size_sum{method="next_token"} 40.0
tgi_batch_inference_batch_size_count{method="next_token"} 10.0
# TYPE tgi_request_duration histogram
tgi_request_duration_sum 9.0
tgi_request_duration_count 3.0
"""

SCRAPE_AFTER = """\
# TYPE tgi_batch_inference_forward_duration histogram
tgi_batch_inference_forward_duration_sum{method="next_token",makeup="single_only"} 9.5
tgi_batch_inference_forward_duration_count{method="next_token",makeup="single_only"} 110.0
tgi_batch_inference_forward_duration_sum{method="next_token",makeup="mixed"} 0.5
tgi_batch_inference_forward_duration_count{method="next_token",makeup="mixed"} 5.0
tgi_batch_inference_forward_duration_sum{method="prefill",makeup="single_only"} 0.5
tgi_batch_inference_forward_duration_count{method="prefill",makeup="single_only"} 2.0
# TYPE tgi_batch_inference_tokproc_duration histogram
tgi_batch_inference_tokproc_duration_sum{method="next_token",makeup="single_only"} 1.25
tgi_batch_inference_tokproc_duration_count{method="next_token",makeup="single_only"} 115.0
tgi_batch_inference_tokproc_duration_sum{method="prefill",makeup="single_only"} 0.1
tgi_batch_inference_tokproc_duration_count{method="prefill",makeup="single_only"} 2.0
# TYPE tgi_batch_inference_batch_size histogram
tgi_batch_inference_batch_size_sum{method="next_token"} 2340.0
tgi_batch_inference_batch_size_count{method="next_token"} 110.0
"""


def test_histogram_totals_add_up_every_makeup():
    totals = histogram_totals(SCRAPE_AFTER)
    forward = totals[("tgi_batch_inference_forward_duration", "next_token")]
    assert (forward.sum, forward.count) == (pytest.approx(10.0), 115.0)
    assert ("tgi_request_duration", "") not in totals


def test_step_shares_are_deltas_between_scrapes():
    shares = step_shares(SCRAPE_BEFORE, SCRAPE_AFTER)
    assert set(shares) == {"next_token"}  # no prefill ran between the scrapes
    share = shares["next_token"]
    assert share.steps == 105
    assert share.forward_seconds == pytest.approx(8.5)
    assert share.tokproc_seconds == pytest.approx(1.0)
    assert share.tokproc_share == pytest.approx(1.0 / 9.5)
    assert share.mean_batch_size == pytest.approx(2300.0 / 100.0)


def test_step_shares_read_the_servers_own_exposition():
    metrics = Metrics(max_sequence_length=64, max_new_tokens=32, max_batch_size=4)
    before = metrics.render().decode()
    for forward, tokproc in ((0.03, 0.01), (0.05, 0.01)):
        metrics.batch_inference_forward_duration.labels(method="next_token", makeup="single_only").observe(
            forward
        )
        metrics.batch_inference_tokproc_duration.labels(method="next_token", makeup="single_only").observe(
            tokproc
        )
        metrics.batch_inference_batch_size.labels(method="next_token").observe(3)
    metrics.batch_inference_forward_duration.labels(method="prefill", makeup="single_only").observe(0.2)
    metrics.batch_inference_tokproc_duration.labels(method="prefill", makeup="single_only").observe(0.0)
    shares = step_shares(before, metrics.render().decode())
    assert shares["next_token"].steps == 2
    assert shares["next_token"].tokproc_share == pytest.approx(0.02 / 0.10)
    assert shares["next_token"].mean_batch_size == pytest.approx(3.0)
    assert shares["prefill"].tokproc_share == 0.0 and shares["prefill"].mean_batch_size is None


def test_speculation_is_read_from_the_servers_counters_between_scrapes():
    metrics = Metrics(max_sequence_length=64, max_new_tokens=32, max_batch_size=4)
    metrics.speculation_proposed.inc(4)  # before the run: not counted
    before = metrics.render().decode()
    assert speculation_share(before, before) is None  # nothing proposed during the run
    metrics.speculation_proposed.inc(12)
    metrics.speculation_accepted.inc(9)
    for gained in (4, 3, 5):  # three sequence-steps with a draft of 4
        metrics.speculation_tokens_per_step.observe(gained)
    share = speculation_share(before, metrics.render().decode())
    assert share == SpeculationShare(proposed=12, accepted=9, speculating_steps=3, tokens_gained=12)
    assert (share.acceptance, share.tokens_per_step) == (0.75, 4.0)


# ---- report ------------------------------------------------------------------------------------------


def _results(*, baselines: bool = True) -> BenchmarkResults:
    def run(concurrency: int, seconds: float) -> LoadRun:
        timings = tuple(
            _timing(i, asked=8, generated=8, latency=seconds / 2, ttft=0.05 * concurrency) for i in range(4)
        )
        return LoadRun(concurrency, True, seconds, timings)

    steps = {"next_token": StepShare("next_token", 40, 3.6, 0.4, 3.5)}
    runs = [summarize(run(1, 8.0)), summarize(run(4, 2.0), steps)]
    return BenchmarkResults(
        created="2025-01-01 00:00 UTC",
        machine=MachineInfo("Test CPU", 2, "2.x", 2, "5.x", "3.11", "Linux", cpu_flags="avx2 avx512_bf16"),
        model=ModelShape("bench-model", "gpt2", 12, 768, 12, 2048, 1024, 87_000_000, "float32"),
        workload=WorkloadInfo(4, "16:128", "32:96", 0, True, 200, 32, "abcd"),
        runs=runs,
        baselines=[BaselineResult("sequential", 1, 32, 16.0), BaselineResult("batched", 4, 32, 1.6)]
        if baselines
        else [],
    )


def test_ratios_compare_the_highest_concurrency_with_each_baseline():
    results = _results()
    assert results.headline.concurrency == 4
    # Server: 32 tokens in 2 s; sequential: 32 in 16 s; batched: 32 in 1.6 s.
    assert results.ratios() == {"sequential": pytest.approx(8.0), "batched": pytest.approx(0.8)}


def test_markdown_report_states_machine_workload_figures_and_ratios():
    text = render_markdown(_results())
    assert "Test CPU" in text and "bench-model" in text and "87.0M parameters" in text
    assert "server / sequential generate(): 8.00x" in text
    assert "server / raw batched decode loop (batch 4): 0.80x" in text
    assert "| 4 | 16.0 | 2.00 | 200.0 | 200.0 | 200.0 |" in text  # concurrency 4: TTFT 0.2 s
    assert "**10.0%** of step time" in text
    assert "![Throughput against concurrency](throughput.png)" in text


def test_console_report_prints_the_ratios_in_words():
    text = console_report(_results())
    assert "server / sequential generate(): 8.00x" in text
    assert "token processing share of next_token step time at concurrency 4: 10.0%" in text


def test_a_report_without_baselines_has_no_ratios():
    results = _results(baselines=False)
    assert results.ratios() == {}
    assert "Ratios" not in render_markdown(results)


def test_write_report_writes_json_markdown_and_a_png(tmp_path: Path):
    paths = write_report(_results(), tmp_path / "out")
    assert sorted(p.name for p in paths) == ["REPORT.md", "results.json", "throughput.png"]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data == json.loads(json.dumps(to_json(_results())))
    assert data["ratios"]["sequential"] == pytest.approx(8.0)
    assert data["runs"][1]["steps"]["next_token"]["tokproc_share"] == pytest.approx(0.1)
    png = (tmp_path / "out" / "throughput.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


# ---- command line ------------------------------------------------------------------------------------


def test_command_line_lists_and_defaults():
    args = parser().parse_args(["--model-dir", "m", "--concurrency", "1,4", "--baselines", "none", "--unary"])
    assert args.concurrency == (1, 4) and args.baselines == () and args.stream is False
    defaults = parser().parse_args(["--model-dir", "m"])
    assert defaults.concurrency == (1, 2, 4, 8, 16, 32) and defaults.baselines == ("sequential", "batched")
    assert defaults.stream is True and defaults.prompt_tokens == LengthRange(16, 128)
    assert _baselines("batched,sequential") == ("sequential", "batched")


@pytest.mark.parametrize("text", ["0,2", "a", ""])
def test_bad_concurrency_lists_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _levels(text)


def test_unknown_baselines_are_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="unknown baselines"):
        _baselines("sequential,vllm")


# ---- shared prefix and the peers --------------------------------------------------------------------


def test_a_shared_prefix_workload_starts_every_prompt_with_the_same_ids(tokenizer):
    spec = WorkloadSpec(6, LengthRange(4, 9), LengthRange(2, 3), seed=3, shared_prefix_tokens=30)
    requests = build_workload(tokenizer, spec)
    prefix = requests[0].input_ids[:30]
    assert all(r.input_ids[:30] == prefix for r in requests)
    assert all(34 <= len(r.input_ids) <= 39 for r in requests)
    assert len({r.input_ids[30:] for r in requests}) > 1  # the questions differ
    for r in requests:  # the server tokenizes each text to exactly these ids
        assert tuple(tokenizer(r.text)["input_ids"]) == r.input_ids


def _peer(name: str, concurrency: int, seconds: float, ttft: float) -> PeerResult:
    timings = tuple(_timing(i, asked=8, generated=8, latency=1.0, ttft=ttft) for i in range(4))
    runs = [summarize(LoadRun(concurrency, True, seconds, timings))]
    return PeerResult(name, f"{name} 1.0", f"how {name} served", runs)


def test_the_report_sets_the_peer_beside_tgis_or_says_it_was_not_run():
    results = _results()
    assert "Not measured in this run: pass `--vllm-python`" in render_markdown(results)
    assert "`--llamacpp-python`" in render_markdown(results)
    peer = _peer("vLLM", 4, seconds=4.0, ttft=0.4)  # half the throughput, twice the TTFT at concurrency 4
    with_peer = dataclasses.replace(results, peers=[peer])
    # ITL: tgis spreads 0.8 s over 7 gaps, the peer 0.6 s.
    assert with_peer.peer_ratios(peer) == [(4, pytest.approx(2.0), pytest.approx(0.5), pytest.approx(4 / 3))]
    text = render_markdown(with_peer)
    assert "### vLLM\n\nvLLM 1.0: how vLLM served." in text
    assert "| 4 | vLLM | 2.00× | 0.50× | 1.33× |" in text
    assert "tgis / vLLM at concurrency 4: tokens/s 2.00×" in console_report(with_peer)
    assert to_json(with_peer)["peers"][0]["ratios"][0]["throughput"] == pytest.approx(2.0)


def test_the_report_sets_every_peer_side_by_side_with_its_ratio():
    vllm = _peer("vLLM", 4, seconds=4.0, ttft=0.4)
    llama = [
        _peer("llama.cpp Q8_0", 1, seconds=4.0, ttft=0.1),
        _peer("llama.cpp Q8_0", 4, seconds=1.0, ttft=0.1),
    ]
    q8 = PeerResult(
        "llama.cpp Q8_0", "llama.cpp (xllamacpp 1.0)", "Q8_0 GGUF", [*llama[0].runs, *llama[1].runs]
    )
    results = dataclasses.replace(_results(), peers=[vllm, q8])
    text = render_markdown(results)
    # tgis: 4 tokens/s at concurrency 1 (32 in 8 s), 16 at 4; llama.cpp 8 and 32; vLLM only ran 4.
    assert (
        "| Concurrency | tgis tokens/s | vLLM tokens/s | tgis / vLLM | llama.cpp Q8_0 tokens/s "
        "| tgis / llama.cpp Q8_0 |"
    ) in text
    assert "| 1 | 4.0 | n/a | n/a | 8.0 | 0.50× |" in text
    assert "| 4 | 16.0 | 8.0 | 2.00× | 32.0 | 0.50× |" in text
    assert "| 1 | llama.cpp Q8_0 | 0.50× |" in text and "| 4 | vLLM | 2.00× |" in text
    assert "| CPU flags | avx2 avx512_bf16 |" in text
    assert "(Test CPU, 2 cores with avx2 avx512_bf16)" in text  # the peers' figures name the CPU too
    data = to_json(results)
    assert [p["name"] for p in data["peers"]] == ["vLLM", "llama.cpp Q8_0"]
    assert [r["concurrency"] for r in data["peers"][1]["ratios"]] == [1, 4]
    console = console_report(results)
    assert "tgis / llama.cpp Q8_0 at concurrency 1: tokens/s 0.50×" in console


def test_the_plot_draws_every_peer(tmp_path: Path):
    results = dataclasses.replace(
        _results(), peers=[_peer("vLLM", 4, 4.0, 0.4), _peer("llama.cpp F32", 4, 2.0, 0.2)]
    )
    paths = write_report(results, tmp_path)
    assert (tmp_path / "throughput.png").read_bytes().startswith(b"\x89PNG") and len(paths) == 3


def test_without_matplotlib_the_report_says_there_is_no_plot(tmp_path: Path, monkeypatch):
    """A GPU machine without a registry may not carry matplotlib: the report is written all the same."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    paths = write_report(_results(), tmp_path)
    assert [path.name for path in paths] == ["results.json", "REPORT.md"]
    text = (tmp_path / "REPORT.md").read_text()
    assert "matplotlib is not installed" in text and "throughput.png" not in text


def test_cpu_flags_keep_the_vector_extensions_in_a_fixed_order():
    x86 = "processor : 0\nflags : fpu sse2 avx512_bf16 avx2 fma avx512f ht\nprocessor : 1\nflags : fpu avx2\n"
    assert cpu_flags(x86) == ["avx2", "fma", "avx512f", "avx512_bf16"]
    assert cpu_flags("Features : fp asimd sve bf16 i8mm\n") == ["asimd", "sve", "bf16", "i8mm"]
    assert cpu_flags("processor : 0\n") == []


def test_a_lone_stream_sets_the_clients_gap_against_the_servers_step():
    # Concurrency 1: 8 tokens in 4 s of which 0.05 s to the first: gaps of 3.95 / 7 s.
    timings = tuple(_timing(i, asked=8, generated=8, latency=4.0, ttft=0.05) for i in range(2))
    steps = {"next_token": StepShare("next_token", 100, 40.0, 10.0, 1.0)}  # 0.5 s a step
    lone = summarize(LoadRun(1, True, 8.0, timings), steps)
    text = "\n".join(lone_stream_lines([lone]))
    gap = 3.95 / 7 * 1e3
    assert f"**{gap:.2f} ms** p50" in text
    assert "500.00 ms mean (400.00 ms scheduling and forward, 100.00 ms token processing" in text
    assert f"Between steps: {gap - 500:.2f} ms" in text
    assert lone_stream_lines([summarize(LoadRun(1, True, 8.0, timings))]) == []  # no metrics: nothing


def test_the_report_shows_speculation_per_level_only_where_the_server_speculated():
    timings = tuple(_timing(i, asked=8, generated=8, latency=1.0, ttft=0.05) for i in range(2))
    plain = summarize(LoadRun(1, True, 2.0, timings))
    speculating = summarize(LoadRun(4, True, 1.0, timings), None, SpeculationShare(40, 30, 10, 40))
    text = "\n".join(speculation_lines([plain, speculating]))
    assert "| 4 | 40 | 30 | 75.0% | 4.00 |" in text and "| 1 |" not in text
    assert speculation_lines([plain]) == []
