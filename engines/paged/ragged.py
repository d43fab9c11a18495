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
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engines.paged import attention as gathered

logger = logging.getLogger(__name__)

PROBE_TOLERANCE = 2e-2  # of the outputs' magnitude, for half-precision kernels against the torch path


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


def probe(
    block_size: int, kv_heads: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Why the kernel cannot serve this KV geometry (None: it can). Runs a small ragged step (two
    decode tokens and a prompt chunk over cached blocks) through the kernel and through the
    per-sequence torch path, which must agree: FlashAttention's paged kernels restrict block sizes
    and dtypes, and the restrictions differ between its versions."""
    if not available(device):
        return "this torch has no paged varlen attention for this device"
    generator = torch.Generator(device=device).manual_seed(0)
    blocks = 8

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    keys, values = (
        random(blocks, block_size, kv_heads, head_dim),
        random(blocks, block_size, kv_heads, head_dim),
    )
    tables, ends, lengths = [(3, 1), (6,), (0, 5, 2)], [block_size + 2, 1, 2 * block_size + 3], [1, 1, 4]
    query = random(sum(lengths), heads, head_dim)
    scale = head_dim**-0.5
    try:
        step = layout(lengths, ends, tables, device)
        got = attention(query, keys, values, step, scale)
    except Exception as exc:  # the kernel refuses this geometry or dtype
        return f"the kernel failed: {exc}"
    want = _torch_path(query, keys, values, tables, ends, lengths, scale)
    deviation = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))
    return (
        None
        if deviation <= PROBE_TOLERANCE
        else f"the kernel deviates by {deviation:.2g} from the torch path"
    )


def _torch_path(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: Sequence[Sequence[int]],
    ends: Sequence[int],
    lengths: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """The same chunks, each through the per-sequence gather and SDPA."""
    out = torch.empty_like(query)
    start = 0
    for table, end, length in zip(tables, ends, lengths, strict=True):
        index = torch.tensor([list(table)], device=query.device)
        chunk = query[start : start + length]
        out[start : start + length] = gathered.prefill_attention(
            chunk,
            keys,
            values,
            index,
            torch.tensor([0], device=query.device),
            torch.tensor([length], device=query.device),
            torch.tensor([end - length], device=query.device),
            scale,
        )
        start += length
    return out
