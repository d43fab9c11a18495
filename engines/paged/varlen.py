"""FlashAttention's varlen forward as this torch build ships it: what it offers, the call, and its semantics
in plain torch (the stand-in the probe compares against and the CPU tests run the CUDA paths with).

The call goes to `torch.ops.aten._flash_attention_forward` itself, not through
`torch.nn.attention.varlen.varlen_attn`: that is a Python custom op (a Python dispatch per layer, and a
`torch.zeros` kernel per call for an unused RNG state). What the operator takes is read from its schema,
so a torch that grows an argument is found without comparing version strings:

- packed keys and values with `cum_seq_k` (the gathered path): every torch 2 CUDA build;
- `window_size_left` / `window_size_right` (sliding windows): later builds (checked, not assumed);
- `block_table` with `seqused_k` (keys read in place from the KV blocks, the paged path): torch 2.13's
  schema has it, 2.11's does not (its `varlen_attn` takes no block table either).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Kernel = Callable[..., torch.Tensor]  # flash_varlen's signature


@dataclass(frozen=True)
class Offer:
    """What the varlen kernel takes on one device (all False off CUDA or without FlashAttention)."""

    varlen: bool
    paged: bool  # block_table and seqused_k: keys read from the KV blocks in place
    window: bool  # window_size_left / window_size_right: sliding-window attention


NONE = Offer(varlen=False, paged=False, window=False)


def schema_arguments() -> frozenset[str]:
    """The argument names of this torch's `aten::_flash_attention_forward` (empty if it has none)."""
    operator = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if operator is None:
        return frozenset()
    return frozenset(argument.name for argument in operator.default._schema.arguments)


def offer(device: torch.device) -> Offer:
    flash_built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    if device.type != "cuda" or not flash_built():
        return NONE
    names = schema_arguments()
    if "cum_seq_k" not in names:
        return NONE
    return Offer(
        varlen=True,
        paged={"block_table", "seqused_k"} <= names,
        window={"window_size_left", "window_size_right"} <= names,
    )


def flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    causal: bool,
    window_left: int = -1,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, H, D] of chunks laid end to end (`cu_seq_q`, int32 [N + 1]); keys and values packed the
    same way (`cu_seq_k`) or, with `block_table` [N, width] and `seqused_k` [N], KV blocks
    [blocks, block_size, Hkv, D]. A chunk's queries are aligned to the end of its keys. `causal=False`
    is for steps whose chunks are all one query, where it means the same and keeps the kernel's
    grouped-query packing on (it needs the window (-1, -1))."""
    extra: dict[str, object] = {}
    if window_left >= 0:
        extra |= {"window_size_left": window_left, "window_size_right": 0 if causal else -1}
    if block_table is not None:
        extra |= {"seqused_k": seqused_k, "block_table": block_table}
    out = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, causal, False, scale=scale, **extra
    )
    return out[0]


def reference_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    causal: bool,
    window_left: int = -1,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """`flash_varlen`'s semantics in torch operators, on any device and without a host sync: every
    query gathers its own sequence's `max_k` key positions and masks what it may not see. Memory grows
    with tokens × max_k, so it is for tests and small probes."""
    tokens, heads, _ = query.shape
    device = query.device
    token = torch.arange(tokens, device=device)
    q_bounds = cu_seq_q.long()
    seq = torch.bucketize(token, q_bounds[1:], right=True)
    q_len = (q_bounds[1:] - q_bounds[:-1])[seq]
    position = torch.arange(max(max_k, 1), device=device)
    if block_table is None:
        assert cu_seq_k is not None
        k_bounds = cu_seq_k.long()
        k_len = (k_bounds[1:] - k_bounds[:-1])[seq]
        index = (k_bounds[seq][:, None] + position).clamp(max=key.shape[0] - 1)
        keys, values = key[index], value[index]  # [T, max_k, Hkv, D]
    else:
        assert seqused_k is not None
        k_len = seqused_k.long()[seq]
        size, width = key.shape[1], block_table.shape[1]
        blocks = block_table.long()[seq][:, (position // size).clamp(max=width - 1)]
        keys, values = key[blocks, position % size], value[blocks, position % size]
    q_pos = k_len - q_len + token - q_bounds[seq]  # each query's position among its sequence's keys
    visible = position < k_len[:, None]
    if causal:
        visible &= position <= q_pos[:, None]
    if window_left >= 0:
        visible &= position >= (q_pos - window_left)[:, None]
    group = heads // keys.shape[2]
    keys = keys.repeat_interleave(group, dim=2).float()
    values = values.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("thd,tkhd->thk", query.float(), keys) * scale
    weights = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("thk,tkhd->thd", weights, values).to(query.dtype)
