"""One attention call per layer for a whole ragged step on CUDA, through `torch.nn.attention.varlen`.

Decode tokens and prompt (or draft) chunks are laid end to end; each chunk attends its sequence's
cached positions plus itself, causally, reading the KV blocks in place through the block table
(FlashAttention's paged varlen kernel, which PyTorch ships). The kernel aligns a chunk's queries to
the end of its keys (query i of a chunk of q at a sequence of k positions attends keys up to
k - q + i), which is exactly the paged step's causality, so one call serves every chunk kind.

`RaggedLayout` is the step's description for the kernel, built once per step by the engine and
shared by every layer; it is plain torch and testable anywhere. The call itself needs a CUDA build
of torch whose varlen attention takes a block table (`available`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RaggedLayout:
    """Where each chunk's queries start in the step (`cu_seq_q`, [N + 1]), how many positions its
    sequence holds once the chunk is written (`seqused_k`, [N]), and its blocks (`block_table`,
    [N, width], padded with block 0), all int32 as the kernel takes them."""

    cu_seq_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    max_k: int


def layout(
    lengths: Sequence[int], ends: Sequence[int], tables: Sequence[Sequence[int]], device: torch.device
) -> RaggedLayout:
    """The layout of chunks of `lengths[i]` tokens ending at position `ends[i]` of sequences whose
    blocks are `tables[i]` (in chunk order: the order of the step's tokens)."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    width = max((len(table) for table in tables), default=0) or 1
    table = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, blocks in enumerate(tables):
        table[i, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    return RaggedLayout(
        cu_seq_q=torch.tensor(starts, dtype=torch.int32).to(device),
        seqused_k=torch.tensor(list(ends), dtype=torch.int32).to(device),
        block_table=table.to(device),
        max_q=max(lengths, default=0),
        max_k=max(ends, default=0),
    )


def available(device: torch.device) -> bool:
    """Whether this torch can run the paged varlen kernel on `device`."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return False
    return "block_table" in inspect.signature(varlen.varlen_attn).parameters


def attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    step: RaggedLayout,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [T, H, D] of every chunk laid end to end; key/value caches [blocks, block_size, Hkv, D]."""
    from torch.nn.attention.varlen import varlen_attn

    window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
    out = varlen_attn(
        query,
        key_cache,
        value_cache,
        step.cu_seq_q,
        None,
        step.max_q,
        step.max_k,
        scale=scale,
        window_size=window,
        enable_gqa=key_cache.shape[2] != query.shape[1],
        seqused_k=step.seqused_k,
        block_table=step.block_table,
    )
    assert isinstance(out, torch.Tensor)
    return out
