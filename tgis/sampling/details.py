"""Token details (SPEC §2.5): logprob, rank and top-n of generated or input tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgis.types import TokenDetail, TopToken

_PROMPT_CHUNK_ROWS = 256  # bounds the float32 log-softmax copy of long prompts


@dataclass(frozen=True)
class DetailRequest:
    """Which details one sequence wants; top_n >= 0."""

    want_logprobs: bool = False
    want_ranks: bool = False
    top_n: int = 0


Candidate = tuple[int, float]  # (token id, logprob)


def token_details(
    logprobs: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[DetailRequest]
) -> list[TokenDetail]:
    """Details of token_ids[i] under logprobs[i] ([m, V] log-softmax of the final scores)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = _ranks(logprobs, chosen, requests)
    tops = top_candidates(logprobs, [r.top_n for r in requests])
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, tops, requests, strict=True)
    return [_detail(tid, lp, rank, top, req) for tid, lp, rank, top, req in rows]


def _ranks(logprobs: torch.Tensor, chosen: torch.Tensor, requests: Sequence[DetailRequest]) -> list[int]:
    """1 + the number of tokens scoring strictly higher than the chosen one."""
    if not any(r.want_ranks for r in requests):
        return [0] * len(requests)
    return ((logprobs > chosen).sum(dim=1) + 1).tolist()


def _detail(
    token_id: int, logprob: float, rank: int, top: list[Candidate], req: DetailRequest
) -> TokenDetail:
    return TokenDetail(
        token_id=token_id,
        logprob=logprob if req.want_logprobs else 0.0,
        rank=rank if req.want_ranks else 0,
        top_tokens=_top_tokens(top, req.want_logprobs),
    )


def _top_tokens(candidates: list[Candidate], with_logprobs: bool) -> tuple[TopToken, ...]:
    if with_logprobs:
        return tuple(TopToken(tid, lp) for tid, lp in candidates)
    return tuple(TopToken(tid, 0.0) for tid in sorted(tid for tid, _ in candidates))


def top_candidates(logprobs: torch.Tensor, top_ns: Sequence[int]) -> list[list[Candidate]]:
    """Per row with n = min(top_n, V) > 0: every finite token >= the n-th highest, at most 4n.

    Sorted by logprob descending, ties to the lower id (which also decides who is cut at 4n).
    """
    out: list[list[Candidate]] = [[] for _ in top_ns]
    positions = [i for i, n in enumerate(top_ns) if n > 0]
    if not positions:
        return out
    vocab = logprobs.shape[1]
    ns = [min(top_ns[i], vocab) for i in positions]
    rows = logprobs[torch.tensor(positions, device=logprobs.device)]
    counts = _candidate_counts(rows, ns)
    fits = [c <= 4 * n for c, n in zip(counts, ns, strict=True)]
    k = max((c for c, fit in zip(counts, fits, strict=True) if fit), default=0)
    values, ids = torch.topk(rows, k) if k else (rows[:, :0], rows[:, :0].long())
    for j, i in enumerate(positions):
        if fits[j]:
            pairs = list(zip(ids[j, : counts[j]].tolist(), values[j, : counts[j]].tolist(), strict=True))
        else:
            pairs = _stable_top(rows[j], 4 * ns[j])
        out[i] = sorted(pairs, key=lambda p: (-p[1], p[0]))
    return out


def _candidate_counts(rows: torch.Tensor, ns: list[int]) -> list[int]:
    index = torch.tensor(ns, device=rows.device).unsqueeze(1) - 1
    nth = torch.topk(rows, max(ns)).values.gather(1, index)
    return ((rows >= nth) & (rows > float("-inf"))).sum(dim=1).tolist()


def _stable_top(row: torch.Tensor, limit: int) -> list[Candidate]:
    """The first `limit` of a descending stable sort: more ties than fit, lowest ids win."""
    values, ids = torch.sort(row, descending=True, stable=True)
    return list(zip(ids[:limit].tolist(), values[:limit].tolist(), strict=True))


def prompt_token_details(
    logits: torch.Tensor, input_ids: Sequence[int], *, want_logprobs: bool, want_ranks: bool, top_n: int
) -> list[TokenDetail]:
    """Decoder-only input-token details from the raw prompt logits [L, V] (SPEC §2.5).

    Entry 0 has no prediction: logprob NaN (if requested), rank 0, no top tokens. Entry i >= 1
    scores input_ids[i] under logits[i - 1].
    """
    if logits.shape[0] != len(input_ids):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(input_ids)} input ids")
    if not input_ids:
        return []
    first = TokenDetail(token_id=input_ids[0], logprob=math.nan if want_logprobs else 0.0)
    request = DetailRequest(want_logprobs, want_ranks, top_n)
    targets = torch.tensor(list(input_ids[1:]), dtype=torch.long, device=logits.device)
    details = [first]
    for start in range(0, len(targets), _PROMPT_CHUNK_ROWS):
        end = min(start + _PROMPT_CHUNK_ROWS, len(targets))
        logprobs = torch.log_softmax(logits[start:end].float(), dim=-1)
        details += token_details(logprobs, targets[start:end], [request] * (end - start))
    return details
