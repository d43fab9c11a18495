"""Paged attention over a KV cache of blocks: per layer [num_blocks, block_size, kv_heads, head_dim].

Pure torch, so the same code runs on CPU and CUDA. Decode attends every decoding sequence at once:
its blocks are gathered into one padded [sequences, positions] view and masked by length. A prompt
chunk gathers its sequence's cached positions and attends causally with SDPA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engines.paged import cpu_kernel


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's keys and values [T, kv_heads, dim] at their slots (block * block_size + offset)."""
    heads, dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[q, k] True where a query at q_pos may attend a key at k_pos (causal, within the window)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """One sequence's query [q, H, D] at positions context.. over its keys/values [k, Hkv, D]."""
    context = key.shape[0] - query.shape[0]
    mask: torch.Tensor | None = None
    if context or sliding_window is not None:
        q_pos = context + torch.arange(query.shape[0], device=query.device)
        mask = _window_mask(q_pos, torch.arange(key.shape[0], device=query.device), sliding_window)
    # A fresh prompt needs no mask tensor: is_causal (on 4-D inputs) lets SDPA pick its fused kernel.
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out[0].transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's first `length` cached positions [length, kv_heads, dim]."""
    blocks = -(-length // cache.shape[1])
    return cache.index_select(0, block_table[:blocks]).flatten(0, 1)[:length]


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    shared_blocks: int = 0,
) -> torch.Tensor:
    """query [N, H, D], one token per sequence at position seq_lens - 1; block_tables [N, max_blocks].

    On CPU the compiled kernel reads the blocks in place; elsewhere (or without it) the blocks are
    gathered into one padded view, masked by length. `shared_blocks` leading blocks are the same in
    every table (a cached prompt prefix): the CPU path attends all queries to them in one batched
    matmul, reading them once, and the kernel only covers the positions after them."""
    if query.device.type == "cpu":
        kernel = cpu_kernel.decode_kernel()
        if kernel is not None:
            return _kernel_decode_attention(
                kernel,
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                scale,
                sliding_window,
                shared_blocks,
            )
    return _gathered_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window
    )


def _kernel_decode_attention(
    kernel: cpu_kernel.DecodeKernel,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    shared_blocks: int,
) -> torch.Tensor:
    """The CPU kernel over the blocks in place; a shared prefix (without a window) is attended apart,
    in one batched matmul, and merged with the kernel's attention over the positions after it."""
    window = sliding_window or 0
    if not shared_blocks or window:
        return kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, window, 0)[0]
    skip = shared_blocks * key_cache.shape[1]
    rest, rest_lse = kernel(query, key_cache, value_cache, block_tables, seq_lens, scale, 0, skip)
    prefix = block_tables[0, :shared_blocks]
    shared, shared_lse = _shared_prefix_attention(query, key_cache, value_cache, prefix, scale)
    return merge_partial_attention(shared, shared_lse, rest, rest_lse).to(query.dtype)


def _gathered_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Every sequence's blocks gathered into one padded [N, positions] view, masked by length (and
    window), through SDPA."""
    count, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    width = block_tables.shape[1] * key_cache.shape[1]
    keys = key_cache[block_tables].view(count, width, kv_heads, dim).transpose(1, 2)
    values = value_cache[block_tables].view(count, width, kv_heads, dim).transpose(1, 2)
    positions = torch.arange(width, device=query.device)
    mask = positions[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        mask &= positions[None, :] >= (seq_lens - sliding_window)[:, None]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=kv_heads != heads,
    )
    return out[:, :, 0, :]


def _shared_prefix_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query [N, H, D] over the same cached blocks: (output [N, H, D] float32, log-sum-exp [N, H]).
    Scores and weighted values are matmuls in the cache dtype, the softmax in float32 (as eager
    attention does)."""
    count, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    # [Hkv, S, D], copied contiguous: a batched matmul over strided keys is about 3x slower.
    keys = key_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1).contiguous()
    values = value_cache.index_select(0, blocks).flatten(0, 1).transpose(0, 1).contiguous()
    # The query heads of one kv head side by side: [Hkv, N * group, D].
    grouped = query.view(count, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    scores = torch.matmul(grouped, keys.transpose(1, 2)).float() * scale
    peak = scores.amax(-1, keepdim=True)
    weights = (scores - peak).exp_()
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights.to(values.dtype), values).float() / total
    lse = (peak + total.log()).view(kv_heads, count, group).permute(1, 0, 2).reshape(count, heads)
    return out.view(kv_heads, count, group, dim).permute(1, 0, 2, 3).reshape(count, heads, dim), lse


def merge_partial_attention(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint sets of positions, each normalised on its own ([N, H, D] with
    log-sum-exps [N, H]), combined into attention over both (float32)."""
    lse = torch.logaddexp(first_lse, second_lse)
    return (
        first.float() * (first_lse - lse).exp()[..., None]
        + second.float() * (second_lse - lse).exp()[..., None]
    )


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: Sequence[int],
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Prompt chunks laid end to end in `query` [T, H, D]; chunk i attends its sequence's first
    context_lens[i] cached positions plus itself, causally. The offsets are host integers: read back
    from device tensors, they would cost a host sync in every layer."""
    out = torch.empty_like(query)
    rows = zip(query_starts, query_lens, context_lens, strict=True)
    for i, (start, length, context) in enumerate(rows):
        total = context + length
        keys = _gather(key_cache, block_tables[i], total)
        values = _gather(value_cache, block_tables[i], total)
        out[start : start + length] = causal_attention(
            query[start : start + length], keys, values, scale, sliding_window
        )
    return out
