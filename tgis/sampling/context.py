"""Per-row token context: the repetition presence mask and the generated-token counts, [B, V] each,
kept only while some row needs them."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RowTable:
    """A [B, V] tensor mirroring the batch rows, allocated only while some row needs it: `table` is
    None then, and rows that do not need it read as zeros once it exists."""

    def __init__(self, vocab_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self._vocab_size = vocab_size
        self._device = device
        self._dtype = dtype
        self._rows = 0
        self.table: torch.Tensor | None = None

    def append_rows(self, rows: int, needed: bool) -> torch.Tensor | None:
        """Append `rows` zero rows (the table is created if `needed`); returns them to fill, or None
        while there is no table."""
        if self.table is None and not needed:
            self._rows += rows
            return None
        new = self._zeros(rows)
        self.table = torch.cat([self._current(), new])
        self._rows += rows
        return self.table[-rows:] if rows else new

    def extend(self, other: RowTable) -> None:
        """Append another table's rows after these (a prefilled group joining the batch)."""
        if self.table is None and other.table is None:
            self._rows += other._rows
            return
        self.table = torch.cat([self._current(), other._current()])
        self._rows += other._rows

    def keep(self, index: torch.Tensor, any_needed: bool) -> None:
        """Keep rows `index` (in that order); drop the table entirely once no row needs it."""
        self._rows = len(index)
        self.table = self.table.index_select(0, index) if self.table is not None and any_needed else None

    def _current(self) -> torch.Tensor:
        return self.table if self.table is not None else self._zeros(self._rows)

    def _zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self._vocab_size, dtype=self._dtype, device=self._device)


class PresenceMask(RowTable):
    """Which token ids each row has seen; rows without a repetition penalty stay all False."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device, torch.bool)

    @property
    def mask(self) -> torch.Tensor | None:
        return self.table

    def append(self, contexts: Sequence[Sequence[int] | None]) -> None:
        """Append rows; None marks a row that does not track its context."""
        tracked = [(i, ids) for i, ids in enumerate(contexts) if ids is not None]
        new = self.append_rows(len(contexts), bool(tracked))
        # Ids beyond the logits width can never be generated, so (as in transformers) they are dropped.
        pairs = [(i, t) for i, ids in tracked for t in ids if 0 <= t < self._vocab_size]
        if new is not None and pairs:
            index = torch.tensor(pairs, dtype=torch.long, device=self._device)
            new[index[:, 0], index[:, 1]] = True

    def add_tokens(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        if self.table is not None:
            self.table[rows, token_ids] = True


class OutputCounts(RowTable):
    """How often each row has generated each token id, for presence/frequency penalties."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device, torch.float32)

    @property
    def counts(self) -> torch.Tensor | None:
        return self.table

    def append(self, rows: int, any_tracked: bool) -> None:
        self.append_rows(rows, any_tracked)

    def add_tokens(self, token_ids: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Count one token for every row (token_ids [B]), or for `rows` only."""
        if self.table is not None:
            chosen = token_ids if rows is None else token_ids.index_select(0, rows)
            if rows is None:
                rows = torch.arange(len(token_ids), device=self._device)
            self.table.index_put_(
                (rows, chosen), torch.ones_like(chosen, dtype=torch.float32), accumulate=True
            )
