"""How many KV blocks the paged engine gets, and what admission may reserve of them.

The pool is sized once at start and never grows, so the memory a running server holds is the model,
the pool and one step's working memory, whatever the load:
- `KV_CACHE_MANAGER_NUM_GPU_BLOCKS` wins when set; blocks hold the engine's block size (KV_BLOCK_SIZE, or
  what its attention path chose);
- on CUDA, the free device memory after loading, within what CUDA_PROCESS_MEMORY_FRACTION leaves this
  process beside what it already holds, less BATCH_SAFETY_MARGIN percent and one step's working memory;
- on CPU, `CPU_MEMORY_BUDGET_MB` (the memory batches may use, as for the padded memory model) less
  one step's working memory; without a budget, room for MAX_BATCH_SIZE sequences of
  MAX_SEQUENCE_LENGTH, capped at half the memory the OS reports available.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engines.base import EngineSpec
from engines.common import available_memory_bytes
from engines.step import PagedEngine
from tgis.batching.paged import BlockWeights
from tgis.config import ServingLimits, Settings, StartupError

logger = logging.getLogger(__name__)

MIB = 1 << 20
# One step's working memory beyond the pool: activations of MAX_STEP_TOKENS tokens (about this many
# hidden-size float32 vectors per token: attention, MLP and norms of one layer at a time), float32
# logits of every sampled row with the sampler's copies, the gathered keys and values of one layer where
# attention gathers them (engines/paged/ragged.py), and a fixed allowance for the allocator and oneDNN's
# scratch memory.
ACTIVATION_VECTORS_PER_TOKEN = 32
LOGITS_COPIES = 4
# Decode graphs: a graph's own logits (the model's dtype, at most float32) and the float32 output buffer
# every graph writes.
GRAPH_LOGITS_COPIES = 2
FIXED_OVERHEAD_BYTES = 64 * MIB


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    block_size: int
    source: str  # how it was sized, for the log line


def step_overhead_bytes(settings: Settings, engine: PagedEngine, limits: ServingLimits) -> int:
    """The stated memory one step may use beyond the model and the KV pool; on CUDA with decode
    graphs, also their private memory pool (one decode step of MAX_BATCH_SIZE sequences, shared by
    every graph) and their shared output, which are captured after the pool is allocated and so must
    be set aside before."""
    spec = engine.spec
    text = spec.model_config.get("text_config") or spec.model_config
    hidden = int(text.get("hidden_size") or text.get("n_embd") or text.get("d_model") or 0)
    per_token = hidden * 4 * ACTIVATION_VECTORS_PER_TOKEN
    activations = settings.max_step_tokens * per_token
    logits = settings.max_batch_size * spec.vocab_size * 4 * LOGITS_COPIES
    # Every running sequence's positions at most: what one step's attention may gather, per layer.
    workspace = engine.workspace_bytes(settings.max_batch_size * limits.max_sequence_length)
    graphs = 0
    if uses_decode_graphs(settings, spec):
        graphs = settings.max_batch_size * (per_token + spec.vocab_size * 4 * GRAPH_LOGITS_COPIES)
    return activations + logits + workspace + graphs + FIXED_OVERHEAD_BYTES


def uses_decode_graphs(settings: Settings, spec: EngineSpec) -> bool:
    """Whether decode steps replay CUDA graphs: the memory set aside for them and their capture both
    follow this one rule."""
    return settings.cuda_graphs and spec.device.type == "cuda"


def cuda_pool_bytes(
    *, free: int, total: int, held: int, fraction: float, margin_percent: int, overhead: int
) -> int:
    """What the KV pool may take on a GPU with `free` bytes free of `total`, where this process already
    holds `held` (reserved by torch's allocator: the weights, with nothing cached) and may hold at most
    `fraction` of the total (CUDA_PROCESS_MEMORY_FRACTION caps what the allocator reserves): the
    smaller of what is free and what the cap leaves, less BATCH_SAFETY_MARGIN percent and one step's
    working memory."""
    allowed = min(free, int(total * fraction) - held)
    return allowed * (100 - margin_percent) // 100 - overhead


def size_pool(settings: Settings, engine: PagedEngine, limits: ServingLimits) -> PoolSize:
    spec, block_size = engine.spec, engine.preferred_block_size
    per_block = engine.kv_shape.bytes_per_block(block_size)
    if settings.kv_cache_manager_num_gpu_blocks is not None:
        return PoolSize(
            settings.kv_cache_manager_num_gpu_blocks, block_size, "KV_CACHE_MANAGER_NUM_GPU_BLOCKS"
        )
    overhead = step_overhead_bytes(settings, engine, limits)
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()  # memory the allocator caches but nothing uses is free for the pool
        free, total = torch.cuda.mem_get_info(spec.device)
        held = torch.cuda.memory_reserved(spec.device)
        fraction = settings.cuda_process_memory_fraction
        usable = cuda_pool_bytes(
            free=free,
            total=total,
            held=held,
            fraction=fraction,
            margin_percent=settings.batch_safety_margin,
            overhead=overhead,
        )
        source = (
            f"{free / MIB:.0f} MiB free on {spec.device}, this process holding {held / MIB:.0f} MiB "
            f"of the {total * fraction / MIB:.0f} MiB it may take"
        )
    elif settings.cpu_memory_budget_mb is not None:
        usable = settings.cpu_memory_budget_mb * MIB - overhead
        source = f"CPU_MEMORY_BUDGET_MB={settings.cpu_memory_budget_mb}"
    else:
        wanted = settings.max_batch_size * limits.max_sequence_length
        usable = -(-wanted // block_size) * per_block
        available = available_memory_bytes()
        source = f"{settings.max_batch_size} × {limits.max_sequence_length} tokens"
        if available is not None and usable > available // 2:
            usable = available // 2
            source = f"half of the {available / MIB:.0f} MiB available"
    if usable < per_block:
        raise StartupError(
            f"No memory is left for KV blocks ({source}, one step needs about {overhead / MIB:.0f} MiB "
            f"beyond them): raise the budget or lower MAX_STEP_TOKENS"
        )
    return PoolSize(int(usable // per_block), block_size, source)


def admission_weights(settings: Settings, pool: PoolSize, reserved_blocks: int) -> BlockWeights:
    """Admission reserves each sequence's worst case in blocks, leaving `reserved_blocks` (the health
    probe's) out of its reach."""
    return BlockWeights(pool.block_size, max_weight=pool.num_blocks - reserved_blocks)
