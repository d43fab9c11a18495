"""Guided-decoding rows of the batch: one xgrammar matcher per guided row, a token bitmask per step.

Rows without a grammar hold None and cost nothing: the bitmask is only built when some row is
guided, and only guided rows are filled and masked. Matchers mirror the sampler's rows through
append/extend/keep and advance with each accepted token.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)


class GuideRows:
    """Per-row grammar matchers (None for unguided rows) in batch row order."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._matchers: list[xgr.GrammarMatcher | None] = []
        self._positions: list[int] = []  # rows with a matcher
        self._bitmask: torch.Tensor | None = None

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
        rows = len(self._matchers)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), self._vocab_size)
        bitmask = self._bitmask[:rows]
        for position in self._positions:
            matcher = self._matchers[position]
            assert matcher is not None
            matcher.fill_next_token_bitmask(bitmask, position)
        on_cpu = scores if scores.device.type == "cpu" else scores.cpu()
        xgr.apply_token_bitmask_inplace(on_cpu, bitmask, vocab_size=self._vocab_size, indices=self._positions)
        if on_cpu is not scores:
            scores.copy_(on_cpu)
        return scores

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
