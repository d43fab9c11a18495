"""Guided-decoding rows of the batch: one xgrammar matcher per guided row, a token bitmask per step.

Rows without a grammar hold None and cost nothing: the bitmask is only built when some row is
guided, and only guided rows are filled and masked. Matchers mirror the sampler's rows through
append/extend/keep and advance with each accepted token.

The matchers fill the bitmask on the host. On the CPU xgrammar's kernel applies it in place. On a GPU
the guided rows' bitmasks (V / 32 int32 each, from a pinned buffer) go to the device in one
asynchronous copy and are applied there to those rows only: copying the whole [B, V] float32 scores to
the host and back (about 65 MB each way at 128 rows of a 128k vocabulary) stalled every guided step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)


class GuideRows:
    """Per-row grammar matchers (None for unguided rows) in batch row order."""

    def __init__(self, vocab_size: int, device: torch.device | None = None) -> None:
        self._vocab_size = vocab_size
        self._matchers: list[xgr.GrammarMatcher | None] = []
        self._positions: list[int] = []  # rows with a matcher
        self._bitmask: torch.Tensor | None = None
        self._on_device = device is not None and device.type != "cpu"  # apply with torch, on the device
        self._pinned = device is not None and device.type == "cuda"
        self._rows: torch.Tensor | None = None  # the guided rows' positions on the device, while unchanged

    @property
    def active(self) -> bool:
        return bool(self._positions)

    def append(self, grammars: Sequence[object | None]) -> None:
        """Add rows; each compiled grammar (xgrammar.CompiledGrammar) gets a fresh matcher."""
        self.append_matchers(self.matchers_for(grammars))

    @staticmethod
    def matchers_for(grammars: Sequence[object | None]) -> list[xgr.GrammarMatcher | None]:
        """A fresh matcher per compiled grammar (None for unguided rows); raises TypeError otherwise."""
        matchers: list[xgr.GrammarMatcher | None] = []
        for grammar in grammars:
            if grammar is None:
                matchers.append(None)
            elif isinstance(grammar, xgr.CompiledGrammar):
                matchers.append(xgr.GrammarMatcher(grammar))
            else:
                raise TypeError(f"not a compiled grammar: {type(grammar).__name__}")
        return matchers

    def append_matchers(self, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        self._matchers += matchers
        self._reindex()

    def extend(self, other: GuideRows) -> None:
        self._matchers += other._matchers
        self._reindex()

    def keep(self, indices: Sequence[int]) -> None:
        self._matchers = [self._matchers[i] for i in indices]
        self._reindex()

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """Set every token a guided row's grammar forbids next to -inf, in place; others untouched."""
        if not self._positions:
            return scores
        if not self._on_device:
            bitmask = self._filled(len(self._matchers), self._positions)  # row i's bits in row i
            vocab = self._vocab_size
            xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=vocab, indices=self._positions)
            return scores
        guided = len(self._positions)
        # The pinned buffer is refilled only after the previous step's sampled tokens reached the host,
        # which waited for everything queued before them, this copy included.
        bitmask = self._filled(guided, range(guided)).to(scores.device, non_blocking=True)
        if self._rows is None:
            self._rows = torch.tensor(self._positions, dtype=torch.long).to(scores.device, non_blocking=True)
        apply_bitmask_rows(scores, bitmask, self._rows, self._vocab_size)
        return scores

    def _filled(self, rows: int, slots: Sequence[int]) -> torch.Tensor:
        """The bitmask [rows, ceil(V / 32)] with each guided row's next-token bits in its slot."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), self._vocab_size)
            if self._pinned:
                self._bitmask = self._bitmask.pin_memory()
        bitmask = self._bitmask[:rows]
        for position, slot in zip(self._positions, slots, strict=True):
            matcher = self._matchers[position]
            assert matcher is not None
            matcher.fill_next_token_bitmask(bitmask, slot)
        return bitmask

    def advance(self, token_ids: Sequence[int], active: frozenset[int] | None = None) -> list[int]:
        """Feed each guided row (each `active` one) its chosen token; return the rows whose grammar
        has now terminated."""
        terminated = []
        for position in self._positions:
            if active is not None and position not in active:
                continue
            matcher = self._matchers[position]
            assert matcher is not None
            if not matcher.accept_token(token_ids[position]):
                # Cannot happen when the token came through the mask; logged, never fatal.
                logger.error(f"guided row {position}: grammar rejected token {token_ids[position]}")
            if matcher.is_terminated():
                terminated.append(position)
        return terminated

    def _reindex(self) -> None:
        self._positions = [i for i, m in enumerate(self._matchers) if m is not None]
        self._rows = None


def apply_bitmask_rows(
    scores: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int
) -> None:
    """scores [B, V] in place: the tokens whose bit is 0 in `bitmask[i]` ([n, ceil(V / 32)] int32, on
    scores' device) become -inf in row `rows[i]`; other rows are untouched. Torch operators only."""
    shifts = torch.arange(32, dtype=torch.int32, device=scores.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    picked = scores.index_select(0, rows)
    picked[:, :vocab_size].masked_fill_(~allowed, float("-inf"))
    scores.index_copy_(0, rows, picked)
