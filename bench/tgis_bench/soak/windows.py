"""The soak's arithmetic: requests and samples cut into time windows, RSS drift and the pass/fail verdicts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tgis_bench.load.stats import Percentiles
from tgis_bench.soak.client import SoakRecord
from tgis_bench.soak.monitor import Sample

RSS_DRIFT_LIMIT = 0.05  # the target: under 5 % after the first window
SERVER_ERROR_CODES = frozenset({"grpc:INTERNAL", "grpc:UNKNOWN"})


@dataclass(frozen=True)
class KindStats:
    """One kind's requests in a window: end-to-end latency and, for streams, time to first token."""

    requests: int
    latency: Percentiles
    ttft: Percentiles | None


@dataclass(frozen=True)
class Window:
    """One slice of the soak: the requests sent in it and the server samples taken in it."""

    index: int
    start: float  # seconds since the soak began
    end: float
    requests: int
    requests_per_second: float
    tokens_per_second: float  # tokens of the requests sent in the window, over its length
    rss_start: int | None  # bytes; None without RSS samples (an external server without its pid)
    rss_end: int | None
    rss_max: int | None
    kv_used_max: int | None
    kv_used_end: int | None
    codes: dict[str, int]
    latency: Percentiles | None
    ttft: Percentiles | None
    kinds: dict[str, KindStats]


def bounds(duration: float, length: float) -> list[tuple[float, float]]:
    """Consecutive windows of `length` seconds covering `duration`; the last may be shorter."""
    if duration <= 0 or length <= 0:
        raise ValueError(f"duration and window length must be positive, got {duration} and {length}")
    edges = []
    start = 0.0
    while start < duration - 1e-9:
        edges.append((start, min(start + length, duration)))
        start += length
    return edges


def windows(
    records: Sequence[SoakRecord], samples: Sequence[Sample], duration: float, length: float
) -> list[Window]:
    """Requests go to the window they were sent in; samples after the load stopped go to the last one."""
    edges = bounds(duration, length)
    result = []
    for index, (start, end) in enumerate(edges):
        last = index == len(edges) - 1
        sent = [r for r in records if start <= r.start < end or (last and r.start >= end)]
        seen = [s for s in samples if start <= s.t < end or (last and s.t >= end)]
        result.append(window(index, start, end, sent, seen))
    return result


def window(
    index: int, start: float, end: float, sent: Sequence[SoakRecord], seen: Sequence[Sample]
) -> Window:
    seconds = end - start
    rss = [s.rss_bytes for s in seen if s.rss_bytes is not None]
    kv = [s.kv_used for s in seen if s.kv_used is not None]
    return Window(
        index=index,
        start=start,
        end=end,
        requests=len(sent),
        requests_per_second=len(sent) / seconds,
        tokens_per_second=sum(r.tokens for r in sent) / seconds,
        rss_start=rss[0] if rss else None,
        rss_end=rss[-1] if rss else None,
        rss_max=max(rss) if rss else None,
        kv_used_max=max(kv) if kv else None,
        kv_used_end=kv[-1] if kv else None,
        codes=dict(sorted(Counter(r.code for r in sent).items())),
        latency=Percentiles.of([r.latency for r in sent]),
        ttft=Percentiles.of([r.ttft for r in sent if r.ttft is not None]),
        kinds=kind_stats(sent),
    )


def kind_stats(records: Sequence[SoakRecord]) -> dict[str, KindStats]:
    by_kind: dict[str, list[SoakRecord]] = {}
    for record in records:
        by_kind.setdefault(record.kind, []).append(record)
    stats = {}
    for kind, mine in sorted(by_kind.items()):
        latency = Percentiles.of([r.latency for r in mine])
        assert latency is not None  # every kind listed has a request
        stats[kind] = KindStats(
            len(mine), latency, Percentiles.of([r.ttft for r in mine if r.ttft is not None])
        )
    return stats


def rss_drift(series: Sequence[Window]) -> tuple[float | None, float | None]:
    """(drift, peak growth) against the RSS at the end of the first window: the last window's end RSS,
    and the highest RSS of any later window. None with fewer than two windows or no RSS samples."""
    if len(series) < 2 or series[0].rss_end is None:
        return None, None
    base = series[0].rss_end
    ends = [w.rss_end for w in series[1:] if w.rss_end is not None]
    peaks = [w.rss_max for w in series[1:] if w.rss_max is not None]
    if not ends:
        return None, None
    return (ends[-1] - base) / base, (max(peaks) - base) / base


def is_server_error(code: str) -> bool:
    """INTERNAL or UNKNOWN over gRPC, a 5xx over HTTP (in the status line or inside a stream)."""
    if code in SERVER_ERROR_CODES:
        return True
    transport, _, rest = code.partition(":")
    status = rest.partition(":")[0]
    return transport == "http" and status.isdigit() and int(status) >= 500


def unexpected(records: Sequence[SoakRecord], expected: Mapping[str, frozenset[str]]) -> dict[str, int]:
    """`kind code` → count, for answers outside what their kind should end with."""
    counts = Counter(f"{r.kind} {r.code}" for r in records if r.code not in expected.get(r.kind, frozenset()))
    return dict(sorted(counts.items()))


@dataclass(frozen=True)
class Verdicts:
    """The soak's targets: RSS drift under 5 %, no server exit, no server error, no KV block left held."""

    rss_drift: float | None
    rss_peak_growth: float | None
    server_exits: int | None  # None: an external server whose process is not watched
    server_errors: int
    unexpected: int  # answers outside their kind's expected outcomes, server errors included
    kv_used_at_end: int | None  # after the load stopped and the drain wait; None: no KV blocks
    kv_drain_seconds: float | None  # how long after the last answer the used blocks reached 0

    def checks(self) -> list[tuple[str, str, bool | None]]:
        """(target, measured, passed) rows; passed is None where it was not measured."""
        drift = "n/a" if self.rss_drift is None else f"{self.rss_drift:+.2%}"
        return [
            (
                f"RSS drift after the first window < {RSS_DRIFT_LIMIT:.0%}",
                drift,
                None if self.rss_drift is None else abs(self.rss_drift) < RSS_DRIFT_LIMIT,
            ),
            (
                "server exits = 0",
                "n/a" if self.server_exits is None else str(self.server_exits),
                None if self.server_exits is None else self.server_exits == 0,
            ),
            ("INTERNAL / UNKNOWN / 5xx = 0", str(self.server_errors), self.server_errors == 0),
            (
                "KV blocks in use after the load = 0",
                "n/a" if self.kv_used_at_end is None else str(self.kv_used_at_end),
                None if self.kv_used_at_end is None else self.kv_used_at_end == 0,
            ),
        ]

    @property
    def passed(self) -> bool:
        return all(ok is not False for _, _, ok in self.checks())
