"""Paired rounds: alternating order, the median's distribution-free interval, ratios per round."""

from __future__ import annotations

import math
import random

import pytest

from tgis_bench.compare.paired import (
    PairedSample,
    _target,
    median_interval,
    render,
    round_order,
    summarize_ratios,
)
from tgis_bench.load.metrics import SpeculationShare


def test_rounds_alternate_the_order_of_the_configurations():
    names = ["off", "off-again", "ngram"]
    assert round_order(names, 0) == names
    assert round_order(names, 1) == ["ngram", "off-again", "off"]
    assert round_order(names, 2) == names


@pytest.mark.parametrize(
    ("n", "rank"),
    [(6, 1), (9, 2), (10, 2), (20, 6), (30, 10)],
)
def test_the_interval_is_the_widest_rank_that_keeps_95_percent(n, rank):
    values = list(range(1, n + 1))
    random.Random(n).shuffle(values)
    low, high, coverage = median_interval(values)
    assert (low, high) == (rank, n + 1 - rank)

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k)
        return sum(math.comb(n, i) for i in range(k)) / 2**n

    assert coverage == pytest.approx(1 - 2 * below(rank))
    assert coverage >= 0.95
    # One rank narrower would fall below 95 %.
    assert 1 - 2 * below(rank + 1) < 0.95


def test_too_few_values_give_their_range_with_its_lower_coverage():
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)
    with pytest.raises(ValueError):
        median_interval([])


def _sample(round_number, concurrency, name, rate, speculation=None):
    return PairedSample(round_number, concurrency, name, rate, 1.0, speculation)


def test_ratios_pair_each_round_with_the_baselines_same_round():
    samples = []
    # The machine speeds up round after round; the configuration is always 10 % faster than off.
    for r in range(7):
        speed = 100.0 * (1 + r / 2)
        samples += [_sample(r, 4, "off", speed), _sample(r, 4, "on", speed * 1.1)]
    (summary,) = summarize_ratios(samples, "off")
    assert summary.name == "on" and summary.concurrency == 4 and summary.rounds == 7
    assert summary.median == pytest.approx(1.1)
    assert summary.low == pytest.approx(1.1) and summary.high == pytest.approx(1.1)
    assert summary.baseline_tokens_per_second == pytest.approx(250.0)
    assert summary.acceptance is None and summary.tokens_per_step is None


def test_a_round_missing_either_side_is_left_out_and_speculation_adds_up():
    spec = SpeculationShare(proposed=10, accepted=6, speculating_steps=4, tokens_gained=10)
    other = SpeculationShare(proposed=30, accepted=12, speculating_steps=6, tokens_gained=12)
    samples = [
        _sample(0, 1, "off", 100.0),
        _sample(0, 1, "ngram", 150.0, spec),
        _sample(1, 1, "off", 100.0),
        _sample(1, 1, "ngram", 90.0, other),
        _sample(2, 1, "ngram", 500.0, spec),  # no baseline in round 2
        _sample(0, 16, "off", 1000.0),
        _sample(0, 16, "ngram", 1000.0),
    ]
    c1, c16 = summarize_ratios(samples, "off")
    assert (c1.concurrency, c1.rounds) == (1, 2)
    assert c1.median == pytest.approx(1.2) and (c1.low, c1.high) == (0.9, 1.5)
    assert c1.acceptance == pytest.approx(18 / 40) and c1.tokens_per_step == pytest.approx(22 / 10)
    assert (c16.concurrency, c16.rounds, c16.median) == (16, 1, 1.0)


def test_the_section_lists_every_level_and_configuration():
    samples = [
        _sample(r, c, name, rate)
        for r in range(6)
        for c in (1, 16)
        for name, rate in (("off", 100.0 + r), ("off-again", 101.0 + r), ("mlp", 95.0 + r))
    ]
    text = render("demo model, mixed workload", "off", summarize_ratios(samples, "off"), "Machine: test")
    assert text.startswith("## demo model, mixed workload\n\nMachine: test\n")
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 16 ")]
    assert [row.split(" | ")[1] for row in rows] == ["off-again", "mlp", "off-again", "mlp"]
    assert "(97%)" in rows[0] and "—" in rows[0]


def test_servers_are_named_with_an_optional_metrics_url():
    assert _target("off=localhost:8033").metrics_url is None
    on = _target("on=localhost:8034,http://127.0.0.1:3001/metrics")
    assert (on.name, on.server, on.metrics_url) == ("on", "localhost:8034", "http://127.0.0.1:3001/metrics")
    with pytest.raises(Exception, match="NAME=HOST:PORT"):
        _target("localhost:8033")
