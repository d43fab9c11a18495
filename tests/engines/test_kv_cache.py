"""The in-place key/value cache: what DynamicCache gives attention, without copying the cache per step."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from engines.kv_cache import MIN_SPARE_POSITIONS, GrowingCache, GrowingLayer


def _states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, 2, length, 4)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def test_updates_return_what_dynamic_cache_returns():
    growing, dynamic = GrowingCache(), DynamicCache()
    for step, length in enumerate([5, 1, 1, 3, *[1] * 40]):
        keys, values = _states(3, length, seed=step)
        for layer in range(2):
            got = growing.update(keys, values, layer)
            want = dynamic.update(keys, values, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(isinstance(layer, GrowingLayer) for layer in growing.layers)
    assert growing.get_seq_length() == dynamic.get_seq_length() == 50


def test_decode_steps_write_into_the_same_buffer_until_the_spare_runs_out():
    layer = GrowingLayer()
    keys, _ = layer.update(*_states(2, 8, seed=0))
    storage = keys.data_ptr()
    spare = MIN_SPARE_POSITIONS  # 8 positions need a buffer of 8 + 16
    for step in range(spare):
        keys, _ = layer.update(*_states(2, 1, seed=step + 1))
        assert keys.data_ptr() == storage, step  # appended in place: no copy of the cache
    keys, _ = layer.update(*_states(2, 1, seed=99))
    assert keys.data_ptr() != storage  # out of room: one larger buffer, then in place again
    assert keys.shape[-2] == 8 + spare + 1


def test_keys_replaced_from_outside_are_taken_over_on_the_next_update():
    """Merging or pruning rows assigns new key/value tensors; the next update must build on those."""
    layer, reference = GrowingLayer(), DynamicCache()
    keys, values = _states(3, 6, seed=1)
    layer.update(keys, values)
    reference.update(keys, values, 0)
    kept = torch.tensor([0, 2])
    assert layer.keys is not None and layer.values is not None
    layer.keys, layer.values = layer.keys[kept], layer.values[kept]
    reference_layer = reference.layers[0]
    assert isinstance(reference_layer, DynamicLayer)
    reference_layer.batch_select_indices(kept)
    step = _states(2, 1, seed=2)
    got, want = layer.update(*step), reference.update(*step, 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
