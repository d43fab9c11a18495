"""A key/value cache that appends in place: a decode step writes one position instead of copying the cache."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

# Spare positions allocated beyond what is needed: a quarter of the length, at least this many.
MIN_SPARE_POSITIONS = 16


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views into buffers with spare positions.

    transformers' DynamicLayer concatenates on every update, copying the whole cache each step. Here an
    update writes into the spare positions and the views grow; only when the spare runs out (or the
    views were replaced from outside, as merging and pruning rows do) is a larger buffer allocated,
    so the copying is amortised to a constant per step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._key_view: torch.Tensor | None = None  # the keys this layer last handed out

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if not self._buffers_hold(key_states, needed):
            self._reallocate(key_states, value_states, length, needed)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., length:needed, :] = key_states
        self._value_buffer[..., length:needed, :] = value_states
        self.keys = self._key_view = self._key_buffer[..., :needed, :]
        self.values = self._value_buffer[..., :needed, :]
        return self.keys, self.values

    def _buffers_hold(self, key_states: torch.Tensor, needed: int) -> bool:
        """The current views are ours (not replaced by a merge or prune) and there is room for `needed`."""
        buffer = self._key_buffer
        return (
            buffer is not None
            and self.keys is self._key_view  # not replaced from outside since our last update
            and needed <= buffer.shape[-2]
            and buffer.shape[:-2] == key_states.shape[:-2]
        )

    def _reallocate(
        self, key_states: torch.Tensor, value_states: torch.Tensor, length: int, needed: int
    ) -> None:
        capacity = needed + max(MIN_SPARE_POSITIONS, needed // 4)
        keys = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if length:
            assert self.keys is not None and self.values is not None
            keys[..., :length, :] = self.keys
            values[..., :length, :] = self.values
        self._key_buffer, self._value_buffer = keys, values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = self._key_view = None
        super().reset()


class GrowingCache(DynamicCache):
    """A DynamicCache made of GrowingLayers, created lazily per layer as transformers fills it."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
