"""The padded engine's running batch: its tensors and KV cache, merged and pruned row by row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache

from engines.common import UnsupportedModelError, left_pad, right_pad


@dataclass
class PaddedBatch:
    """Tensors describing the running rows; every tensor's first dim is the row."""

    cache: Cache
    attention_mask: torch.Tensor  # [B, T] over cached (decoder) positions
    next_positions: torch.Tensor  # [B] position id of each row's next token
    encoder_hidden: torch.Tensor | None = None  # [B, S, H], encoder-decoder only
    encoder_mask: torch.Tensor | None = None  # [B, S]

    @property
    def rows(self) -> int:
        return int(self.attention_mask.shape[0])


def _self_attention_layers(cache: Cache) -> list[DynamicLayer]:
    source = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    return _dynamic_layers(source)


def _dynamic_layers(cache: Cache) -> list[DynamicLayer]:
    """The cache's layers; the architectures served here all use plain dynamic key/value layers."""
    layers = list(cache.layers)
    if not all(isinstance(layer, DynamicLayer) for layer in layers):
        raise UnsupportedModelError("only dynamic key/value caches can be batched")
    return cast(list[DynamicLayer], layers)


Pad = Callable[[torch.Tensor, int, int], torch.Tensor]


def _stack(old: torch.Tensor, new: torch.Tensor, pad: Pad, length: int, dim: int) -> torch.Tensor:
    """Pad both to `length` along `dim`, then put `new`'s rows after `old`'s."""
    return torch.cat([pad(old, length, dim), pad(new, length, dim)])


def _stack_layers(old: list[DynamicLayer], new: list[DynamicLayer], pad: Pad, length: int) -> None:
    for old_layer, new_layer in zip(old, new, strict=True):
        assert old_layer.keys is not None and old_layer.values is not None
        assert new_layer.keys is not None and new_layer.values is not None
        old_layer.keys = _stack(old_layer.keys, new_layer.keys, pad, length, 2)
        old_layer.values = _stack(old_layer.values, new_layer.values, pad, length, 2)


def _index_layers(layers: list[DynamicLayer], index: tuple[Any, ...]) -> None:
    for layer in layers:
        assert layer.keys is not None and layer.values is not None
        layer.keys = layer.keys[index]
        layer.values = layer.values[index]


def merge(old: PaddedBatch, new: PaddedBatch) -> PaddedBatch:
    """Append `new` rows after `old` rows, left-padding the shorter decoder cache."""
    length = max(old.attention_mask.shape[1], new.attention_mask.shape[1])
    _stack_layers(_self_attention_layers(old.cache), _self_attention_layers(new.cache), left_pad, length)
    old.attention_mask = _stack(old.attention_mask, new.attention_mask, left_pad, length, 1)
    old.next_positions = torch.cat([old.next_positions, new.next_positions])
    if isinstance(old.cache, EncoderDecoderCache) and isinstance(new.cache, EncoderDecoderCache):
        _merge_encoder(old, new, old.cache, new.cache)
    return old


def _merge_encoder(
    old: PaddedBatch, new: PaddedBatch, old_cache: EncoderDecoderCache, new_cache: EncoderDecoderCache
) -> None:
    """Right-pad encoder states and cross-attention caches to a common source length, then stack."""
    assert old.encoder_hidden is not None and new.encoder_hidden is not None
    assert old.encoder_mask is not None and new.encoder_mask is not None
    length = max(old.encoder_mask.shape[1], new.encoder_mask.shape[1])
    _stack_layers(
        _dynamic_layers(old_cache.cross_attention_cache),
        _dynamic_layers(new_cache.cross_attention_cache),
        right_pad,
        length,
    )
    old.encoder_hidden = _stack(old.encoder_hidden, new.encoder_hidden, right_pad, length, 1)
    old.encoder_mask = _stack(old.encoder_mask, new.encoder_mask, right_pad, length, 1)


def select(batch: PaddedBatch, indices: torch.Tensor) -> None:
    """Keep only `indices` rows, then drop cache columns that are padding in every remaining row."""
    mask = batch.attention_mask[indices]
    live_columns = mask.any(dim=0).nonzero()
    start = int(live_columns[0]) if live_columns.numel() else mask.shape[1]
    batch.attention_mask = mask[:, start:]
    batch.next_positions = batch.next_positions[indices]
    _index_layers(_self_attention_layers(batch.cache), (indices, slice(None), slice(start, None)))
    if isinstance(batch.cache, EncoderDecoderCache):
        assert batch.encoder_hidden is not None and batch.encoder_mask is not None
        _index_layers(_dynamic_layers(batch.cache.cross_attention_cache), (indices,))
        batch.encoder_hidden = batch.encoder_hidden[indices]
        batch.encoder_mask = batch.encoder_mask[indices]
