"""KV pool sizing (tgis/startup/kv_pool.py): the arithmetic on a GPU under CUDA_PROCESS_MEMORY_FRACTION,
and what one step is said to need beyond the pool (the gathered keys' workspace, decode graphs)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engines.base import EngineSpec
from engines.step import KVCacheShape
from tgis.config import ServingLimits, Settings
from tgis.startup import kv_pool

GIB = 1 << 30


def test_the_pool_takes_what_the_fraction_leaves_beside_what_the_process_holds() -> None:
    """80 GiB card, fraction 0.5, the weights hold 20 GiB, 60 GiB free: the cap leaves 20 GiB, not 40."""
    usable = kv_pool.cuda_pool_bytes(
        free=60 * GIB, total=80 * GIB, held=20 * GIB, fraction=0.5, margin_percent=20, overhead=GIB
    )
    assert usable == 20 * GIB * 80 // 100 - GIB


def test_without_a_cap_the_free_memory_bounds_the_pool() -> None:
    """Another process holds 15 GiB: only the 45 GiB free count, whatever the fraction allows."""
    usable = kv_pool.cuda_pool_bytes(
        free=45 * GIB, total=80 * GIB, held=20 * GIB, fraction=1.0, margin_percent=0, overhead=0
    )
    assert usable == 45 * GIB


def test_a_process_already_at_its_cap_has_nothing_left_for_the_pool() -> None:
    usable = kv_pool.cuda_pool_bytes(
        free=50 * GIB, total=80 * GIB, held=30 * GIB, fraction=0.25, margin_percent=20, overhead=0
    )
    assert usable < 0


class Engine(SimpleNamespace):
    """What sizing reads of a paged engine."""

    def workspace_bytes(self, positions: int) -> int:
        return positions * self.per_position


def engine(per_position: int, device: str = "cpu") -> Engine:
    spec = EngineSpec(
        False, 1000, (), 0, torch.device(device), torch.float16, {"hidden_size": 64}, paged=True
    )
    return Engine(
        spec=spec, kv_shape=KVCacheShape(2, 2, 16, 2), preferred_block_size=16, per_position=per_position
    )


def test_the_step_overhead_counts_the_gathered_keys_of_every_running_sequence() -> None:
    settings = Settings(max_batch_size=8, max_step_tokens=32)
    limits = ServingLimits(max_sequence_length=128, max_new_tokens=64)
    plain = kv_pool.step_overhead_bytes(settings, engine(0), limits)  # type: ignore[arg-type]
    gathered = kv_pool.step_overhead_bytes(settings, engine(128), limits)  # type: ignore[arg-type]
    assert gathered - plain == 8 * 128 * 128


def test_decode_graphs_set_aside_one_steps_activations_and_two_logits_copies() -> None:
    settings = Settings(max_batch_size=8, max_step_tokens=32)
    limits = ServingLimits(max_sequence_length=128, max_new_tokens=64)
    on_gpu = engine(0, "cuda")
    with_graphs = kv_pool.step_overhead_bytes(settings, on_gpu, limits)  # type: ignore[arg-type]
    without = kv_pool.step_overhead_bytes(settings.model_copy(update={"cuda_graphs": False}), on_gpu, limits)  # type: ignore[arg-type]
    per_token = 64 * 4 * kv_pool.ACTIVATION_VECTORS_PER_TOKEN
    assert with_graphs - without == 8 * (per_token + 1000 * 4 * kv_pool.GRAPH_LOGITS_COPIES)
