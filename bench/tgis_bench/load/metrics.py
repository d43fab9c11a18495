"""The server's own step timings and speculation counts: /metrics scraped before and after a run, the
counters and histogram sums subtracted."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

FORWARD = "tgi_batch_inference_forward_duration"
TOKPROC = "tgi_batch_inference_tokproc_duration"
BATCH_SIZE = "tgi_batch_inference_batch_size"
METHODS = ("prefill", "next_token")
PROPOSED = "tgi_speculation_proposed_tokens"
ACCEPTED = "tgi_speculation_accepted_tokens"
TOKENS_PER_STEP = "tgi_speculation_tokens_per_step"


@dataclass(frozen=True)
class Totals:
    """A histogram's `_sum` and `_count`, added over every label but `method`."""

    sum: float = 0.0
    count: float = 0.0

    def __sub__(self, other: Totals) -> Totals:
        return Totals(self.sum - other.sum, self.count - other.count)


@dataclass(frozen=True)
class StepShare:
    """Where one kind of step spent its time during a run: model forward vs token processing.

    Token processing is everything after the forward in a step: sampler, detokenizer, stop rules,
    handing events to the server side. Admission scheduling and pruning finished rows happen between
    steps and are in neither histogram (the report shows that remainder against the run's wall time).
    """

    method: str
    steps: int
    forward_seconds: float
    tokproc_seconds: float
    mean_batch_size: float | None

    @property
    def mean_step_seconds(self) -> float:
        """A step's forward and token processing, on average."""
        return (self.forward_seconds + self.tokproc_seconds) / self.steps if self.steps else 0.0

    @property
    def tokproc_share(self) -> float:
        total = self.forward_seconds + self.tokproc_seconds
        return self.tokproc_seconds / total if total > 0 else 0.0


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode("utf-8"))


def histogram_totals(text: str) -> dict[tuple[str, str], Totals]:
    """(histogram name, method) → totals, for the step histograms in a Prometheus text exposition."""
    wanted = {
        f"{name}_{part}": (name, part) for name in (FORWARD, TOKPROC, BATCH_SIZE) for part in ("sum", "count")
    }
    totals: dict[tuple[str, str], Totals] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in wanted or "method" not in sample.labels:
                continue
            name, part = wanted[sample.name]
            key = (name, sample.labels["method"])
            old = totals.get(key, Totals())
            totals[key] = (
                Totals(old.sum + sample.value, old.count)
                if part == "sum"
                else Totals(old.sum, old.count + sample.value)
            )
    return totals


def step_shares(before: str, after: str) -> dict[str, StepShare]:
    """Per method, the steps taken between two scrapes and how their time split."""
    start, end = histogram_totals(before), histogram_totals(after)

    def delta(name: str, method: str) -> Totals:
        return end.get((name, method), Totals()) - start.get((name, method), Totals())

    shares = {}
    for method in METHODS:
        forward, tokproc, sizes = delta(FORWARD, method), delta(TOKPROC, method), delta(BATCH_SIZE, method)
        if forward.count <= 0:
            continue
        shares[method] = StepShare(
            method=method,
            steps=round(forward.count),
            forward_seconds=forward.sum,
            tokproc_seconds=tokproc.sum,
            mean_batch_size=sizes.sum / sizes.count if sizes.count > 0 else None,
        )
    return shares


@dataclass(frozen=True)
class SpeculationShare:
    """What speculative decoding did during a run: draft tokens verified and accepted, and how many
    tokens a speculating sequence gained per step (accepted drafts + the model's own token)."""

    proposed: int
    accepted: int
    speculating_steps: int  # sequence-steps that carried a draft
    tokens_gained: int  # over those sequence-steps

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens_gained / self.speculating_steps if self.speculating_steps else 0.0


def _speculation_counts(text: str) -> dict[str, float]:
    wanted = {f"{PROPOSED}_total", f"{ACCEPTED}_total", f"{TOKENS_PER_STEP}_sum", f"{TOKENS_PER_STEP}_count"}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:  # unlabelled; tgis exposes each counter under two names, one value
                counts[sample.name] = sample.value
    return counts


def speculation_share(before: str, after: str) -> SpeculationShare | None:
    """Speculation between two scrapes; None where the server proposed no draft token in between."""
    start, end = _speculation_counts(before), _speculation_counts(after)

    def delta(name: str) -> int:
        return round(end.get(name, 0.0) - start.get(name, 0.0))

    proposed = delta(f"{PROPOSED}_total")
    if proposed <= 0:
        return None
    return SpeculationShare(
        proposed=proposed,
        accepted=delta(f"{ACCEPTED}_total"),
        speculating_steps=delta(f"{TOKENS_PER_STEP}_count"),
        tokens_gained=delta(f"{TOKENS_PER_STEP}_sum"),
    )
