"""vLLM's `bad_words`: words a request must never produce, banned as token sequences.

A word is banned both as written and after a space (the same word mid-text tokenizes differently).
At every step, each banned sequence whose leading tokens the row's context ends with has its last
token set to -inf, so the sequence can never complete, wherever it would start. A one-token sequence
is banned at every step. The context is the prompt and the tokens generated so far (decoder-only
models) or the generated tokens alone (encoder-decoder models), as transformers'
NoBadWordsLogitsProcessor reads `input_ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TokenSequences = tuple[tuple[int, ...], ...]


def word_sequences(words: Sequence[str], encode: Callable[[str], Sequence[int]]) -> TokenSequences:
    """Each word's token sequences, on its own and after a space, each distinct sequence once.
    Raises ValueError for a word with no tokens."""
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        bare = word.lstrip()
        if not bare:
            raise ValueError("bad_words entries must not be empty")
        for text in (bare, " " + bare):
            ids = tuple(int(i) for i in encode(text))
            if ids:
                found[ids] = None
    return tuple(found)


def completing_ids(context: Sequence[int], sequences: TokenSequences) -> list[int]:
    """The ids that would complete one of `sequences` right after `context`."""
    banned = []
    for sequence in sequences:
        lead = len(sequence) - 1
        if lead == 0 or (len(context) >= lead and tuple(context[len(context) - lead :]) == sequence[:-1]):
            banned.append(sequence[-1])
    return banned


def ban_(scores: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set `scores[i, t]` [B, V] to -inf, in place, for every id t in `banned[i]`: one scatter."""
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    if not rows:
        return scores
    ids = [t for row_ids in banned for t in row_ids]
    index = (torch.tensor(rows, device=scores.device), torch.tensor(ids, device=scores.device))
    return scores.index_put_(index, torch.tensor(float("-inf"), device=scores.device))


class BadWordRows:
    """The sampler's rows' banned sequences and the context each needs (its last tokens), mirrored on
    the batch through append / extend / keep like the sampler's other per-row state."""

    def __init__(self) -> None:
        self._sequences: list[TokenSequences] = []
        self._contexts: list[list[int]] = []

    @property
    def active(self) -> bool:
        return any(self._sequences)

    def append(self, sequences: Sequence[TokenSequences], contexts: Sequence[Sequence[int]]) -> None:
        for banned, context in zip(sequences, contexts, strict=True):
            self._sequences.append(banned)
            self._contexts.append(self._tail(banned, list(context)))

    def extend(self, other: BadWordRows) -> None:
        self._sequences += other._sequences
        self._contexts += other._contexts

    def keep(self, indices: Sequence[int]) -> None:
        self._sequences = [self._sequences[i] for i in indices]
        self._contexts = [self._contexts[i] for i in indices]

    def mask(self, scores: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Ban, in `scores` [B, V] (row i is batch row `rows[i]`, default: the batch in order), every id
        that would complete a banned sequence now."""
        if not self.active:
            return scores
        order = range(len(self._sequences)) if rows is None else rows
        banned = [completing_ids(self._contexts[row], self._sequences[row]) for row in order]
        return ban_(scores, banned)

    def advance(self, token_ids: Sequence[int], active: frozenset[int] | None) -> None:
        """Each row's new token (rows outside `active`, when given, took none)."""
        if not self.active:
            return
        for row, token in enumerate(token_ids):
            if self._sequences[row] and (active is None or row in active):
                self._contexts[row] = self._tail(self._sequences[row], [*self._contexts[row], token])

    @staticmethod
    def _tail(sequences: TokenSequences, context: list[int]) -> list[int]:
        """The context a row's check reads: its last (longest sequence - 1) tokens."""
        keep = max((len(s) - 1 for s in sequences), default=0)
        return context[len(context) - keep :] if keep else []
