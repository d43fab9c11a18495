"""What a batch runner reports for one step, as plain data keyed by request id (no torch, no positions).

The loop core hands a `StepResult` to the output processor and a `StepStats` to the metrics; tests
fabricate both to drive the loop without a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tgis.types import TokenDetail

if TYPE_CHECKING:
    from tgis.engine_loop.beam_search import FinishedBeam


@dataclass(frozen=True)
class SampledToken:
    """One token chosen for a request, with its scores when the request asked for them."""

    token_id: int
    detail: TokenDetail | None = None


@dataclass(frozen=True)
class InputDetails:
    """A prompt's positions for input token details: every id the model saw (virtual prefix slots as
    the pad id, then the input) and their scores; `details` is None for encoder-decoder models,
    whose prompt positions have no logits (text only)."""

    token_ids: tuple[int, ...]
    details: tuple[TokenDetail, ...] | None


@dataclass(frozen=True)
class RowFailure:
    """Why one request failed in a step; `per_request` details say how far it got (SPEC §3.2)."""

    detail: str
    per_request: bool = True


@dataclass(frozen=True)
class StepStats:
    """What the metrics record of one forward pass."""

    method: str  # "prefill" (the step computed prompt tokens) or "next_token"
    batch_size: int  # sequences (or chunks) the forward computed
    prompt_tokens: int  # prompt positions computed, padding included (tgi_batch_next_tokens)
    started: float  # time.monotonic() at schedule
    forward_done: float  # after the forward, before token processing
    input_tokens: int = 0  # tokens the batch holds now, padding included (tgi_batch_input_tokens)
    joined: bool = False  # a prefill merged into a running batch (tgi_batch_concatenation_count)
    draft_tokens: int = 0  # proposed tokens the step verified
    speculative_runs: tuple[int, ...] = ()  # tokens each sequence with a draft gained (accepted + 1)

    @property
    def accepted_tokens(self) -> int:
        return sum(run - 1 for run in self.speculative_runs)


@dataclass(frozen=True)
class StepResult:
    """Everything one step produced, by request id.

    `tokens` lists the tokens each request gained, in order (one per step today; several once
    speculation accepts more). `failed` requests failed on their own and are released after the
    step; `engine_error` says the forward itself failed ("oom" or "error"), so health turns FAILED.
    """

    stats: StepStats | None = None
    tokens: Mapping[int, tuple[SampledToken, ...]] = field(default_factory=dict)
    input_details: Mapping[int, InputDetails] = field(default_factory=dict)
    guide_finished: frozenset[int] = frozenset()
    failed: Mapping[int, RowFailure] = field(default_factory=dict)
    engine_error: str | None = None
    # Beam-search requests whose search ended this step: their finished beams, best first.
    beams: Mapping[int, tuple[FinishedBeam, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchUsage:
    """What the running batch holds, for the load gauges: admitted requests and the KV capacity share."""

    admitted: int
    kv_cache_usage: float  # 0-1
    blocks_total: int | None = None  # paged runners: the KV pool's blocks by state
    blocks_used: int | None = None
    blocks_cached: int | None = None
