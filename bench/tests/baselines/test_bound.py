"""The weights-bandwidth bound: its arithmetic, the weight classification, the copy it times."""

from __future__ import annotations

import pytest
import torch

from tgis_bench.baselines.bound import (
    COPY_REPEATS,
    CopyBandwidth,
    DecodeBound,
    WeightTraffic,
    bound_json,
    bound_rows,
    count_weight_traffic,
    decode_step_ratio,
    measure_copy_bandwidth,
)
from tgis_bench.load.client import LoadRun, RequestTiming
from tgis_bench.load.metrics import StepShare
from tgis_bench.load.stats import RunSummary, summarize

# 2 GB of weights per step; a 1 GB copy at best in 0.4 s moves 2 GB read + written: 5 GB/s, so 0.4 s a step.
BOUND = DecodeBound(
    WeightTraffic(
        parameters=1_100_000_000,
        read_parameters=1_000_000_000,
        lookup_tables=("embed",),
        bytes_per_parameter=2,
    ),
    CopyBandwidth("test device", 1_000_000_000, (0.5, 0.4, 0.6), "test timer"),
)


def _run(
    concurrency: int, seconds: float, gap: float, steps: dict[str, StepShare] | None = None
) -> RunSummary:
    """Four requests of 9 tokens each, every inter-token gap `gap` seconds."""
    timings = tuple(RequestTiming(i, 10, 9, 9, "MAX_TOKENS", 1.0, 0.2, (gap,) * 8) for i in range(4))
    return summarize(LoadRun(concurrency, True, seconds, timings), steps)


def test_the_bound_is_the_weight_bytes_over_the_best_copy_bandwidth():
    assert BOUND.weights.bytes_per_step == 2_000_000_000
    assert BOUND.bandwidth.bytes_per_second == pytest.approx(5e9)  # 2 × 1 GB / 0.4 s
    assert BOUND.bandwidth.median_bytes_per_second == pytest.approx(4e9)
    assert BOUND.step_seconds == pytest.approx(0.4)
    assert BOUND.tokens_per_second(1) == pytest.approx(2.5)
    assert BOUND.tokens_per_second(8) == pytest.approx(20.0)
    assert BOUND.step_ratio(1.0) == pytest.approx(2.5)
    assert BOUND.throughput_share(10.0, 8) == pytest.approx(0.5)


def test_each_level_is_set_against_the_bound_at_its_batch():
    steps = {"next_token": StepShare("next_token", 10, 7.0, 1.0, 4.0)}  # 0.8 s a step
    runs = [_run(4, 3.6, gap=1.2, steps=steps), _run(1, 18.0, gap=0.8)]
    first, second = bound_rows(BOUND, runs)
    assert first.concurrency == 1 and second.concurrency == 4  # in concurrency order
    assert first.tokens_per_second == pytest.approx(2.0)  # 36 tokens in 18 s
    assert first.bound_tokens_per_second == pytest.approx(2.5)
    assert first.throughput_share == pytest.approx(0.8)
    assert first.itl_ratio == pytest.approx(2.0) and first.step_ratio is None  # no metrics in that run
    assert second.bound_tokens_per_second == pytest.approx(10.0)
    assert second.throughput_share == pytest.approx(1.0)
    assert second.step_seconds == pytest.approx(0.8) and second.step_ratio == pytest.approx(2.0)
    assert decode_step_ratio(BOUND, runs) == pytest.approx(2.0)  # ITL p50 0.8 s at concurrency 1
    assert decode_step_ratio(BOUND, runs[:1]) is None
    data = bound_json(BOUND, runs)
    assert data["step_seconds"] == pytest.approx(0.4) and data["decode_step_ratio"] == pytest.approx(2.0)
    assert [row["concurrency"] for row in data["rows"]] == [1, 4]


class _Tied(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)
        self.positions = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 100, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_only_the_tables_a_step_looks_up_are_left_out(tie):
    traffic = count_weight_traffic(_Tied(tie), bytes_per_parameter=4)
    body, head, embed, positions = 8 * 8 + 8, 100 * 8, 100 * 8, 16 * 8
    if tie:  # the embedding is the head: read whole, counted once
        assert traffic.lookup_tables == ("positions.weight",)
        assert (traffic.parameters, traffic.read_parameters) == (body + head + positions, body + head)
    else:
        assert traffic.lookup_tables == ("embed.weight", "positions.weight")
        assert (traffic.parameters, traffic.read_parameters) == (body + head + embed + positions, body + head)
    assert traffic.bytes_per_step == 4 * traffic.read_parameters


def test_a_cpu_copy_is_timed_with_the_wall_clock():
    copy = measure_copy_bandwidth(torch.device("cpu"), nbytes=1 << 20)
    assert copy.bytes_copied == 1 << 20 and len(copy.seconds) == COPY_REPEATS
    assert copy.timer == "time.perf_counter" and copy.device.startswith("cpu (")
    assert all(seconds > 0 for seconds in copy.seconds)
    assert copy.bytes_per_second >= copy.median_bytes_per_second > 0
