"""Per-row token context: the repetition presence mask and the generated-token counts, [B, V] each,
kept only while some row needs them."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PresenceMask:
    """Which token ids each row has seen; rows without a repetition penalty stay all False."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self._vocab_size = vocab_size
        self._device = device
        self._rows = 0
        self.mask: torch.Tensor | None = None

    def append(self, contexts: Sequence[Sequence[int] | None]) -> None:
        """Append rows; None marks a row that does not track its context."""
        tracked = [(i, ids) for i, ids in enumerate(contexts) if ids is not None]
        if self.mask is None and not tracked:
            self._rows += len(contexts)
            return
        new = torch.zeros(len(contexts), self._vocab_size, dtype=torch.bool, device=self._device)
        self._fill(new, tracked)
        self.mask = torch.cat([self._current(), new])
        self._rows += len(contexts)

    def extend(self, other: PresenceMask) -> None:
        """Append another mask's rows after these (a prefilled group joining the batch)."""
        if self.mask is None and other.mask is None:
            self._rows += other._rows
            return
        self.mask = torch.cat([self._current(), other._current()])
        self._rows += other._rows

    def keep(self, index: torch.Tensor, any_tracked: bool) -> None:
        """Keep rows `index` (in that order); drop the mask entirely once no row tracks context."""
        self._rows = len(index)
        self.mask = self.mask.index_select(0, index) if self.mask is not None and any_tracked else None

    def add_tokens(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        if self.mask is not None:
            self.mask[rows, token_ids] = True

    def _current(self) -> torch.Tensor:
        if self.mask is not None:
            return self.mask
        return torch.zeros(self._rows, self._vocab_size, dtype=torch.bool, device=self._device)

    def _fill(self, new: torch.Tensor, tracked: list[tuple[int, Sequence[int]]]) -> None:
        # Ids beyond the logits width can never be generated, so (as in transformers) they are dropped.
        pairs = [(i, t) for i, ids in tracked for t in ids if 0 <= t < self._vocab_size]
        if pairs:
            index = torch.tensor(pairs, dtype=torch.long, device=self._device)
            new[index[:, 0], index[:, 1]] = True


class OutputCounts:
    """How often each row has generated each token id, for presence/frequency penalties."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self._vocab_size = vocab_size
        self._device = device
        self._rows = 0
        self.counts: torch.Tensor | None = None

    def append(self, rows: int, any_tracked: bool) -> None:
        if self.counts is None and not any_tracked:
            self._rows += rows
            return
        new = torch.zeros(rows, self._vocab_size, dtype=torch.float32, device=self._device)
        self.counts = torch.cat([self._current(), new])
        self._rows += rows

    def extend(self, other: OutputCounts) -> None:
        if self.counts is None and other.counts is None:
            self._rows += other._rows
            return
        self.counts = torch.cat([self._current(), other._current()])
        self._rows += other._rows

    def keep(self, index: torch.Tensor, any_tracked: bool) -> None:
        self._rows = len(index)
        self.counts = self.counts.index_select(0, index) if self.counts is not None and any_tracked else None

    def add_tokens(self, token_ids: torch.Tensor) -> None:
        """Count one token for every row (token_ids [B])."""
        if self.counts is not None:
            rows = torch.arange(len(token_ids), device=self._device)
            self.counts.index_put_(
                (rows, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True
            )

    def _current(self) -> torch.Tensor:
        if self.counts is not None:
            return self.counts
        return torch.zeros(self._rows, self._vocab_size, dtype=torch.float32, device=self._device)
