"""The attention function registered with transformers for the flat, paged step.

The model runs unmodified: every attention layer calls `paged_attention` (registered under
`ATTENTION_NAME` in transformers' `AttentionInterface`) with the step's queries, keys and values
for all its tokens ([1, heads, tokens, dim]). The function writes the new keys and values into
the layer's KV blocks, then attends each token to its own sequence's cached positions. Which
tokens belong to which sequence, and where their blocks are, travels with the forward call as
the `tgis_paged` keyword argument (`StepContext`), which transformers hands down to attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from engines.paged import attention, cpu_kernel, ragged
from engines.paged.ragged import RaggedLayout

ATTENTION_NAME = "tgis_paged"
CONTEXT_KWARG = "tgis_paged"


@dataclass(frozen=True)
class FusedLayers:
    """A CPU step whose layers each write their keys and values and attend in one call to `kernel`
    (cpu_decode.cpp's decode_layer), every token a query of its own over its sequence's positions up
    to its own: every token of the step, in step order, with its sequence's block table and length."""

    kernel: cpu_kernel.DecodeLayerKernel
    block_tables: torch.Tensor  # [T, max_blocks], padded with block 0
    lengths: torch.Tensor  # [T] the token's own position + 1


@dataclass
class StepContext:
    """Where one step's tokens go: decode tokens (one per sequence) first, then prefill chunks. Each path
    reads only its own fields, and a step builds only those (engines/paged/step_context.py)."""

    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of every token
    num_decode: int  # the first num_decode tokens are single-token decode chunks
    # The per-sequence path: decode tokens over padded tables, prompt chunks one by one. The chunks'
    # offsets are host integers, so that no layer reads a device tensor back.
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks], padded with block 0
    decode_lengths: torch.Tensor | None = None  # [num_decode] positions each decode token attends
    prefill_block_tables: torch.Tensor | None = None  # [chunks, max_blocks]
    prefill_starts: tuple[int, ...] = ()  # each chunk's first token in the step, from num_decode
    prefill_lengths: tuple[int, ...] = ()  # tokens of each chunk
    prefill_contexts: tuple[int, ...] = ()  # positions cached before each chunk
    decode_shared_blocks: int = 0  # leading blocks every decode table has in common (a cached prefix)
    # On CPU with the kernel built, when every chunk is short (step_inputs.per_token_tables) and no
    # shared prefix is split off (that split attends the prefix apart, in one batched matmul).
    fused: FusedLayers | None = None
    # On CUDA with the varlen kernel: every chunk in one call per layer (engines/paged/ragged.py).
    ragged: RaggedLayout | None = None
    # Shape discovery: when set, layers only record (kv_heads, head_dim) and attend within the step.
    discovered: dict[int, tuple[int, int]] | None = None

    @property
    def attends_fused(self) -> bool:
        """Every layer writes and attends through the kernels' one call (no shape discovery)."""
        return self.fused is not None and self.discovered is None


def traces_whole(forward_kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward call's attention runs fused in every layer (the kernels' operator, which a
    compiled graph holds), so that the call traces into one graph; every other path would break it,
    and under PT2_COMPILE runs eagerly on the CPU (engines/compiled.py)."""
    context = forward_kwargs.get(CONTEXT_KWARG)
    return isinstance(context, StepContext) and context.attends_fused


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: [1, H, T, D] in, [1, T, H, D] out. A fused step's layers
    trace into a compiled graph (PT2_COMPILE) as one operator each; every other path is eager (on CUDA
    the graphs break around it)."""
    context: StepContext = kwargs[CONTEXT_KWARG]
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    fused = context.fused
    if fused is None or not context.attends_fused:
        return _eager_paged_attention(context, layer, query, key, value, scale, sliding_window)[None], None
    # Compiled, the build's dispatcher operator (cpu_decode.cpp), which inductor calls from C++.
    kernel = torch.ops.tgis.decode_layer if torch.compiler.is_compiling() else fused.kernel
    out = kernel(
        query,
        key,
        value,
        context.key_caches[layer],
        context.value_caches[layer],
        context.slot_mapping,
        fused.block_tables,
        fused.lengths,
        scale,
        sliding_window or 0,
    )
    return out[None], None


@torch.compiler.disable
def _eager_paged_attention(
    context: StepContext,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Every path but the fused one ([tokens, heads, head_dim] out): shape discovery, the ragged CUDA
    kernel, or decode tokens and prompt chunks apart."""
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    if context.discovered is not None:
        context.discovered[layer] = (int(key.shape[1]), int(key.shape[3]))
        return attention.causal_attention(q, k, v, scale, sliding_window)
    key_cache, value_cache = context.key_caches[layer], context.value_caches[layer]
    attention.write_kv(key_cache, value_cache, k, v, context.slot_mapping)
    if context.ragged is not None:
        return ragged.attention(q, key_cache, value_cache, context.ragged, scale, sliding_window)
    decode = context.num_decode
    out = torch.empty_like(q)  # the per-sequence path
    if decode:
        out[:decode] = _attend_decode_tokens(
            context, q[:decode], key_cache, value_cache, scale, sliding_window
        )
    if decode < q.shape[0]:
        out[decode:] = _attend_prompt_chunks(
            context, q[decode:], key_cache, value_cache, scale, sliding_window
        )
    return out


def _attend_decode_tokens(
    context: StepContext,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The step's decode tokens (one per sequence, [N, H, D]) over their sequences' blocks."""
    assert context.decode_block_tables is not None and context.decode_lengths is not None
    return attention.decode_attention(
        query,
        key_cache,
        value_cache,
        context.decode_block_tables,
        context.decode_lengths,
        scale,
        sliding_window,
        context.decode_shared_blocks,
    )


def _attend_prompt_chunks(
    context: StepContext,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The step's prompt chunks, laid end to end after the decode tokens, each over its cached
    positions and itself."""
    assert context.prefill_block_tables is not None
    return attention.prefill_attention(
        query,
        key_cache,
        value_cache,
        context.prefill_block_tables,
        context.prefill_starts,
        context.prefill_lengths,
        context.prefill_contexts,
        scale,
        sliding_window,
    )


def register() -> None:
    """Make `ATTENTION_NAME` a valid attn_implementation (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)
