"""Aggregates of a load run: throughput and latency percentiles, plus the server's step-time split."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tgis_bench.load.client import LoadRun
from tgis_bench.load.metrics import SpeculationShare, StepShare


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


@dataclass(frozen=True)
class Percentiles:
    """p50 / p90 / p99 in seconds."""

    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles | None:
        if not values:
            return None
        return cls(percentile(values, 50), percentile(values, 90), percentile(values, 99))


@dataclass(frozen=True)
class RunSummary:
    """One concurrency level as the report shows it."""

    concurrency: int
    stream: bool
    requests: int
    seconds: float
    generated_tokens: int
    asked_tokens: int
    tokens_per_second: float
    requests_per_second: float
    latency: Percentiles
    ttft: Percentiles | None  # None for unary runs
    inter_token: Percentiles | None
    short_requests: int  # requests whose generated count differs from what was asked
    steps: dict[str, StepShare]  # by method (prefill, next_token); empty without a metrics URL
    speculation: SpeculationShare | None = None  # None without a metrics URL or without speculation

    @property
    def next_token_share(self) -> StepShare | None:
        return self.steps.get("next_token")


def summarize(
    run: LoadRun, steps: dict[str, StepShare] | None = None, speculation: SpeculationShare | None = None
) -> RunSummary:
    """Throughput counts every generated token over the wall time of the whole run."""
    timings = run.requests
    generated = sum(t.generated_tokens for t in timings)
    ttfts = [t.ttft for t in timings if t.ttft is not None]
    gaps = [gap for t in timings for gap in t.inter_token]
    latency = Percentiles.of([t.latency for t in timings])
    if latency is None:
        raise ValueError("a load run with no requests")
    return RunSummary(
        concurrency=run.concurrency,
        stream=run.stream,
        requests=len(timings),
        seconds=run.seconds,
        generated_tokens=generated,
        asked_tokens=sum(t.asked_tokens for t in timings),
        tokens_per_second=generated / run.seconds,
        requests_per_second=len(timings) / run.seconds,
        latency=latency,
        ttft=Percentiles.of(ttfts),
        inter_token=Percentiles.of(gaps),
        short_requests=sum(t.generated_tokens != t.asked_tokens for t in timings),
        steps=dict(steps or {}),
        speculation=speculation,
    )
