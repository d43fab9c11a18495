"""Which batch rows use which processor, with their parameters as tensors; rebuilt when rows change."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tgis.sampling.config import SamplingConfig
from tgis.sampling.details import DetailRequest
from tgis.types import LengthPenalty


@dataclass(frozen=True)
class Rows:
    """A subset of batch rows; `take`/`put` skip the gather/scatter when it is the whole batch."""

    positions: tuple[int, ...]
    index: torch.Tensor
    all_rows: bool

    def take(self, batch: torch.Tensor) -> torch.Tensor:
        return batch if self.all_rows else batch.index_select(0, self.index)

    def put(self, batch: torch.Tensor, subset: torch.Tensor) -> torch.Tensor:
        if self.all_rows:
            return subset
        return batch.index_copy_(0, self.index, subset)

    def within(self, active: frozenset[int] | None) -> Rows | None:
        """These rows that are also `active` (None: every row is); None when none is."""
        if active is None:
            return self
        positions = tuple(p for p in self.positions if p in active)
        if not positions:
            return None
        if positions == self.positions:
            return self
        index = torch.tensor(positions, dtype=torch.long, device=self.index.device)
        return Rows(positions, index, all_rows=False)


@dataclass(frozen=True)
class RowParam:
    """Rows using one processor and its per-row parameter as an [n, 1] tensor."""

    rows: Rows
    value: torch.Tensor


@dataclass(frozen=True)
class TopKParam:
    rows: Rows
    k: torch.Tensor  # [n, 1] int64, each in [1, V)
    k_max: int


@dataclass(frozen=True)
class LengthPenaltyParam:
    rows: Rows
    start: torch.Tensor  # [n] int64
    decay: torch.Tensor  # [n] float64


@dataclass(frozen=True)
class PenaltyParam:
    """Rows with a presence or frequency penalty, each as an [n, 1] tensor."""

    rows: Rows
    presence: torch.Tensor
    frequency: torch.Tensor


@dataclass(frozen=True)
class LogitBiasParam:
    """Every (row, token id, bias) entry of the batch, flattened (batch row positions)."""

    rows: torch.Tensor  # [m] int64
    ids: torch.Tensor  # [m] int64
    bias: torch.Tensor  # [m] float32


@dataclass(frozen=True)
class RowTokens:
    """(row, token id) pairs of the batch, flattened: each row's own extra stop ids."""

    rows: torch.Tensor  # [m] int64 batch row positions
    ids: torch.Tensor  # [m] int64


@dataclass(frozen=True)
class DetailParam:
    rows: Rows
    requests: tuple[DetailRequest, ...]


@dataclass(frozen=True)
class BatchPlan:
    """Every processor's row subset (None when no row uses it), in pipeline order."""

    # [B] each row's min_new_tokens (0 where it sets none, or is guided); None when no row sets one
    min_new_tokens: torch.Tensor | None
    # the rows' own stop ids (vLLM's stop_token_ids), suppressed with EOS under min_new_tokens
    stop_tokens: RowTokens | None
    length_penalty: LengthPenaltyParam | None
    repetition: RowParam | None
    penalties: PenaltyParam | None
    logit_bias: LogitBiasParam | None
    watermarks: tuple[tuple[int, tuple[float, float]], ...]  # (row, (gamma, delta)); rare, so per row
    temperature: RowParam | None
    top_k: TopKParam | None
    top_p: RowParam | None
    min_p: RowParam | None
    typical_p: RowParam | None
    sampling: Rows | None
    details: DetailParam | None


class _Builder:
    """Turns the row configs into subsets on one device."""

    def __init__(self, configs: Sequence[SamplingConfig], vocab_size: int, device: torch.device) -> None:
        self.configs = configs
        self.vocab_size = vocab_size
        self.device = device

    def rows(self, use: Callable[[SamplingConfig], bool]) -> Rows | None:
        positions = tuple(i for i, c in enumerate(self.configs) if use(c))
        if not positions:
            return None
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        return Rows(positions, index, all_rows=len(positions) == len(self.configs))

    def column(
        self, rows: Rows, value: Callable[[SamplingConfig], float], dtype: torch.dtype
    ) -> torch.Tensor:
        values = [value(self.configs[i]) for i in rows.positions]
        return torch.tensor(values, dtype=dtype, device=self.device).unsqueeze(1)

    def param(
        self,
        use: Callable[[SamplingConfig], bool],
        value: Callable[[SamplingConfig], float],
        dtype: torch.dtype = torch.float32,
    ) -> RowParam | None:
        rows = self.rows(use)
        return None if rows is None else RowParam(rows, self.column(rows, value, dtype))

    def whole_batch(
        self, use: Callable[[SamplingConfig], bool], value: Callable[[SamplingConfig], int]
    ) -> torch.Tensor | None:
        """[B] int64: `value` on the rows that `use` it, 0 on the others; None when no row does."""
        if not any(use(c) for c in self.configs):
            return None
        values = [value(c) if use(c) else 0 for c in self.configs]
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def top_k(self) -> TopKParam | None:
        rows = self.rows(lambda c: not c.greedy and 0 < c.top_k < self.vocab_size)
        if rows is None:
            return None
        k = self.column(rows, lambda c: c.top_k, torch.long)
        return TopKParam(rows, k, max(self.configs[i].top_k for i in rows.positions))

    def length_penalty(self) -> LengthPenaltyParam | None:
        rows = self.rows(lambda c: c.length_penalty is not None and c.length_penalty.decay_factor != 1.0)
        if rows is None:
            return None

        def flat(value: Callable[[SamplingConfig], float], dtype: torch.dtype) -> torch.Tensor:
            return self.column(rows, value, dtype).squeeze(1)

        return LengthPenaltyParam(
            rows,
            start=flat(lambda c: _penalty(c).start_index, torch.long),
            decay=flat(lambda c: _penalty(c).decay_factor, torch.float64),
        )

    def penalties(self) -> PenaltyParam | None:
        rows = self.rows(lambda c: c.counts_output)
        if rows is None:
            return None
        presence = self.column(rows, lambda c: c.presence_penalty, torch.float32)
        return PenaltyParam(rows, presence, self.column(rows, lambda c: c.frequency_penalty, torch.float32))

    def logit_bias(self) -> LogitBiasParam | None:
        # Ids beyond the logits width cannot be generated: dropped, as for the repetition context.
        entries = [
            (row, token, bias)
            for row, c in enumerate(self.configs)
            for token, bias in c.logit_bias
            if token < self.vocab_size
        ]
        if not entries:
            return None
        rows, ids, bias = zip(*entries, strict=True)
        return LogitBiasParam(
            torch.tensor(rows, dtype=torch.long, device=self.device),
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(bias, dtype=torch.float32, device=self.device),
        )

    def stop_tokens(self) -> RowTokens | None:
        """Each row's stop ids while it has a minimum to reach (ids beyond the logits are dropped)."""
        pairs = [
            (row, token)
            for row, c in enumerate(self.configs)
            if c.min_new_tokens > 0 and c.guide is None
            for token in c.stop_token_ids
            if token < self.vocab_size
        ]
        if not pairs:
            return None
        rows, ids = zip(*pairs, strict=True)
        return RowTokens(
            torch.tensor(rows, dtype=torch.long, device=self.device),
            torch.tensor(ids, dtype=torch.long, device=self.device),
        )

    def details(self) -> DetailParam | None:
        rows = self.rows(lambda c: c.wants_details)
        if rows is None:
            return None
        requests = tuple(_detail_request(self.configs[i]) for i in rows.positions)
        return DetailParam(rows, requests)


def build_plan(configs: Sequence[SamplingConfig], vocab_size: int, device: torch.device) -> BatchPlan:
    b = _Builder(configs, vocab_size, device)
    return BatchPlan(
        # Guided rows end when their grammar does (SamplingConfig.guide), so EOS stays open to them.
        min_new_tokens=b.whole_batch(
            lambda c: c.min_new_tokens > 0 and c.guide is None, lambda c: c.min_new_tokens
        ),
        stop_tokens=b.stop_tokens(),
        length_penalty=b.length_penalty(),
        repetition=b.param(lambda c: c.repetition_penalty != 1.0, lambda c: c.repetition_penalty),
        penalties=b.penalties(),
        logit_bias=b.logit_bias(),
        watermarks=tuple((row, c.watermark) for row, c in enumerate(configs) if c.watermark is not None),
        temperature=b.param(lambda c: not c.greedy and c.temperature != 1.0, lambda c: c.temperature),
        top_k=b.top_k(),
        # 1 - top_p is taken in float64 before the cast, as transformers compares with a Python float.
        top_p=b.param(lambda c: not c.greedy and 0 < c.top_p < 1, lambda c: 1 - c.top_p),
        min_p=b.param(lambda c: not c.greedy and c.min_p > 0, lambda c: c.min_p),
        typical_p=b.param(lambda c: not c.greedy and 0 < c.typical_p < 1, lambda c: c.typical_p),
        sampling=b.rows(lambda c: not c.greedy),
        details=b.details(),
    )


def _penalty(config: SamplingConfig) -> LengthPenalty:
    assert config.length_penalty is not None
    return config.length_penalty


def _detail_request(config: SamplingConfig) -> DetailRequest:
    return DetailRequest(config.want_logprobs, config.want_ranks, config.top_n)
