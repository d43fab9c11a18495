"""One varlen attention call per layer for a whole ragged step: decode tokens and prompt (or draft) chunks
laid end to end, each attending its sequence's cached positions plus itself, causally.

The kernel (engines/paged/varlen.py) aligns a chunk's queries to the end of its keys (query i of a chunk
of q at a sequence of k positions attends keys up to k - q + i), which is exactly the paged step's
causality, so one call serves every chunk kind. It reads keys one of two ways:

- paged: in place from the KV blocks through a block table (torch builds whose kernel takes one, at a
  block size it accepts);
- gathered: packed, after one `index_select` per layer of the step's cached positions (keys and
  values) into a workspace allocated once per step and reused by every layer; the slot index is
  computed on the device once per step from the block tables.

`RaggedLayout` is the step's description for the kernel, shared by every layer; everything here is plain
torch without host syncs, so the CPU tests run it with the kernel's torch stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.paged.varlen import Kernel


@dataclass
class Workspace:
    """The gathered keys and values of a step, [positions, Hkv, D] each, reused by every layer."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def empty(cls, positions: int, like: torch.Tensor) -> Workspace:
        shape = (positions, like.shape[2], like.shape[3])
        return cls(
            torch.empty(shape, dtype=like.dtype, device=like.device),
            torch.empty(shape, dtype=like.dtype, device=like.device),
        )

    @property
    def positions(self) -> int:
        return int(self.keys.shape[0])

    @staticmethod
    def bytes_per_position(kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        return 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class RaggedLayout:
    """Where each chunk's queries start (`cu_seq_q`, int32 [N + 1]) and its blocks (`block_table`, int32
    [N, width]); paged: how many positions each sequence holds once the chunk is written (`seqused_k`,
    int32 [N]); gathered: where each sequence's keys start in the workspace (`cu_seq_k`, int32 [N + 1])
    and the cache slot of every workspace row (`gather`, int64). `causal` is False when every chunk is
    one query (the same attention, and FlashAttention then packs grouped-query heads)."""

    kernel: Kernel
    cu_seq_q: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    seqused_k: torch.Tensor | None = None
    cu_seq_k: torch.Tensor | None = None
    gather: torch.Tensor | None = None
    workspace: Workspace | None = None

    @property
    def paged(self) -> bool:
        return self.gather is None


def gather_slots(
    cu_seq_k: torch.Tensor, block_table: torch.Tensor, block_size: int, rows: int, scratch_slot: int
) -> torch.Tensor:
    """The cache slot of each of `rows` workspace rows: row j belongs to the sequence whose range of
    `cu_seq_k` holds it, at that sequence's position j - cu_seq_k[seq]; rows past the last sequence's
    end (a CUDA graph's fixed size) read `scratch_slot`. Device operators only (no host sync)."""
    device = block_table.device
    bounds = cu_seq_k.long()
    row = torch.arange(rows, device=device)
    seq = torch.bucketize(row, bounds[1:], right=True).clamp(max=block_table.shape[0] - 1)
    position = row - bounds[seq]
    block = (position // block_size).clamp(min=0, max=block_table.shape[1] - 1)
    slots = block_table.long()[seq, block] * block_size + position % block_size
    return torch.where(row < bounds[-1], slots, scratch_slot)


def attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: RaggedLayout,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [T, H, D] of every chunk laid end to end; key/value caches [blocks, block_size, Hkv, D]."""
    window = -1 if sliding_window is None else sliding_window - 1
    if step.paged:
        return step.kernel(
            query,
            key_cache,
            value_cache,
            step.cu_seq_q,
            None,
            step.max_q,
            step.max_k,
            scale=scale,
            causal=step.causal,
            window_left=window,
            seqused_k=step.seqused_k,
            block_table=step.block_table,
        )
    assert step.gather is not None and step.workspace is not None
    rows = step.gather.shape[0]
    keys, values = step.workspace.keys[:rows], step.workspace.values[:rows]
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    torch.index_select(key_cache.view(-1, heads, dim), 0, step.gather, out=keys)
    torch.index_select(value_cache.view(-1, heads, dim), 0, step.gather, out=values)
    return step.kernel(
        query,
        keys,
        values,
        step.cu_seq_q,
        step.cu_seq_k,
        step.max_q,
        step.max_k,
        scale=scale,
        causal=step.causal,
        window_left=window,
    )
