"""Per-architecture shard plans: which modules split by column, by row, by vocabulary, and head counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from engines.hf_custom_tp.layers import Shard, rank_range
from engines.hf_custom_tp.weights import Segment, Split


class UnsupportedShardingError(ValueError):
    pass


@dataclass(frozen=True)
class Column:
    """Split output features (fused layouts: per segment); no communication."""

    segments: tuple[Segment, ...] | None = None
    conv1d: bool = False  # GPT-2 style Conv1D stores [in, out]


@dataclass(frozen=True)
class Row:
    """Split input features; all-reduce the partial sums."""

    conv1d: bool = False


@dataclass(frozen=True)
class VocabEmbedding:
    """Split the vocabulary rows of an input embedding."""


@dataclass(frozen=True)
class VocabHead:
    """Split the vocabulary rows of the LM head; all-gather the logits."""


@dataclass(frozen=True)
class SplitWeight:
    """Keep the module but load its weight split (T5's per-head relative attention bias)."""

    split: Split


Rule = Column | Row | VocabEmbedding | VocabHead | SplitWeight
Patch = Callable[[nn.Module, Any, Shard], None]


@dataclass(frozen=True)
class ShardPlan:
    rules: tuple[tuple[str, Rule], ...]
    patch: Patch | None = None

    def rule_for(self, module_name: str) -> Rule | None:
        for pattern, rule in self.rules:
            if fnmatchcase(module_name, pattern):
                return rule
        return None


def _require_divisible(what: str, count: int, world_size: int) -> None:
    if count % world_size:
        raise UnsupportedShardingError(
            f"hf_custom_tp: {what} ({count}) is not divisible by the number of shards ({world_size})"
        )


def _local(count: int, shard: Shard) -> int:
    start, end = rank_range(count, shard)
    return end - start


def _modules(model: nn.Module, cls: type) -> list[Any]:
    return [module for module in model.modules() if isinstance(module, cls)]


# ---- llama family and gpt_neox: attention reshapes with -1 heads, so nothing to patch --------------


def _llama(config: Any, world_size: int) -> ShardPlan:
    _require_divisible("num_attention_heads", config.num_attention_heads, world_size)
    _require_divisible("num_key_value_heads", config.num_key_value_heads, world_size)
    _require_divisible("intermediate_size", config.intermediate_size, world_size)
    return ShardPlan(
        rules=(
            ("*.self_attn.[qkv]_proj", Column()),
            ("*.self_attn.o_proj", Row()),
            ("*.mlp.gate_proj", Column()),
            ("*.mlp.up_proj", Column()),
            ("*.mlp.down_proj", Row()),
            ("model.embed_tokens", VocabEmbedding()),
            ("lm_head", VocabHead()),
        )
    )


def _gpt_neox(config: Any, world_size: int) -> ShardPlan:
    _require_divisible("num_attention_heads", config.num_attention_heads, world_size)
    _require_divisible("intermediate_size", config.intermediate_size, world_size)
    # query_key_value is laid out [head][q|k|v][head_dim], so a contiguous split keeps whole heads.
    return ShardPlan(
        rules=(
            ("*.attention.query_key_value", Column()),
            ("*.attention.dense", Row()),
            ("*.mlp.dense_h_to_4h", Column()),
            ("*.mlp.dense_4h_to_h", Row()),
            ("gpt_neox.embed_in", VocabEmbedding()),
            ("embed_out", VocabHead()),
        )
    )


# ---- bloom: fused [head][q|k|v] layout, ALiBi slopes per head -----------------------------------------


def _patch_bloom(model: nn.Module, config: Any, shard: Shard) -> None:
    from transformers.models.bloom import modeling_bloom as bloom

    heads = config.n_head
    local = _local(heads, shard)
    start, end = rank_range(heads, shard)
    for module in _modules(model, bloom.BloomAttention) + _modules(model, bloom.BloomMLP):
        module.slow_but_exact = False  # its slices index full-width weights
    for module in _modules(model, bloom.BloomAttention) + _modules(model, bloom.BloomBlock):
        module.num_heads = local

    def build_alibi(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        # ALiBi slopes depend on the global head count: take this rank's heads of the full tensor.
        rows = attention_mask.shape[0]
        alibi = bloom.build_alibi_tensor(attention_mask, heads, dtype).view(rows, heads, 1, -1)
        return alibi[:, start:end].reshape(rows * local, 1, -1)

    for base in _modules(model, bloom.BloomModel):
        # The engine always passes an attention mask, so BloomModel takes this path, never the
        # mask-less one that computes slopes inline.
        base.num_heads = local
        base.build_alibi_tensor = build_alibi


def _bloom(config: Any, world_size: int) -> ShardPlan:
    _require_divisible("n_head", config.n_head, world_size)
    return ShardPlan(
        rules=(
            ("*.self_attention.query_key_value", Column()),
            ("*.self_attention.dense", Row()),
            ("*.mlp.dense_h_to_4h", Column()),
            ("*.mlp.dense_4h_to_h", Row()),
            ("transformer.word_embeddings", VocabEmbedding()),
            ("lm_head", VocabHead()),
        ),
        patch=_patch_bloom,
    )


# ---- gpt2: Conv1D layers, c_attn laid out [q | k | v] ------------------------------------------------


def _patch_gpt2(model: nn.Module, config: Any, shard: Shard) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    local = _local(config.n_head, shard)
    for attention in _modules(model, GPT2Attention):
        attention.num_heads = local
        attention.embed_dim = local * attention.head_dim
        attention.split_size = attention.embed_dim


def _gpt2(config: Any, world_size: int) -> ShardPlan:
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedShardingError("hf_custom_tp: gpt2 with cross-attention is not supported")
    _require_divisible("n_head", config.n_head, world_size)
    inner = config.n_inner or 4 * config.n_embd
    _require_divisible("n_inner", inner, world_size)
    qkv = tuple(Segment(config.n_embd) for _ in range(3))
    return ShardPlan(
        rules=(
            ("*.attn.c_attn", Column(segments=qkv, conv1d=True)),
            ("*.attn.c_proj", Row(conv1d=True)),
            ("*.mlp.c_fc", Column(conv1d=True)),
            ("*.mlp.c_proj", Row(conv1d=True)),
            ("transformer.wte", VocabEmbedding()),
            ("lm_head", VocabHead()),
        ),
        patch=_patch_gpt2,
    )


# ---- gpt_bigcode: multi-query keeps its single key/value head on every rank ---------------------------


def _patch_bigcode(model: nn.Module, config: Any, shard: Shard) -> None:
    from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention

    local = _local(config.n_head, shard)
    for attention in _modules(model, GPTBigCodeAttention):
        attention.num_heads = local
        attention.embed_dim = local * attention.head_dim
        attention.split_size = attention.embed_dim
        attention.kv_heads = 1 if attention.multi_query else local
        attention.kv_dim = attention.kv_heads * attention.head_dim
        attention.num_key_value_groups = local // attention.kv_heads


def _gpt_bigcode(config: Any, world_size: int) -> ShardPlan:
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedShardingError("hf_custom_tp: gpt_bigcode with cross-attention is not supported")
    _require_divisible("n_head", config.n_head, world_size)
    inner = config.n_inner or 4 * config.n_embd
    _require_divisible("n_inner", inner, world_size)
    head_dim = config.n_embd // config.n_head
    qkv = (
        (Segment(config.n_embd), Segment(head_dim, sharded=False), Segment(head_dim, sharded=False))
        if config.multi_query
        else None  # [head][q|k|v][head_dim]: contiguous
    )
    return ShardPlan(
        rules=(
            ("*.attn.c_attn", Column(segments=qkv)),
            ("*.attn.c_proj", Row()),
            ("*.mlp.c_fc", Column()),
            ("*.mlp.c_proj", Row()),
            ("transformer.wte", VocabEmbedding()),
            ("lm_head", VocabHead()),
        ),
        patch=_patch_bigcode,
    )


# ---- falcon: three fused query_key_value layouts -----------------------------------------------------


def _patch_falcon(model: nn.Module, config: Any, shard: Shard) -> None:
    from transformers.models.falcon.modeling_falcon import FalconAttention

    local = _local(config.num_attention_heads, shard)
    for attention in _modules(model, FalconAttention):
        attention.num_heads = local
        if attention.new_decoder_architecture:
            attention.num_kv_heads = _local(config.num_kv_heads, shard)
        elif not attention.multi_query:
            attention.num_kv_heads = local
        # transformers >= 5.25 repeats K/V by this count (it was derived from the unsharded head counts).
        if hasattr(attention, "num_key_value_groups"):
            attention.num_key_value_groups = attention.num_heads // attention.num_kv_heads


def _falcon(config: Any, world_size: int) -> ShardPlan:
    if config.alibi:
        raise UnsupportedShardingError("hf_custom_tp: falcon with ALiBi is not supported")
    heads = config.num_attention_heads
    _require_divisible("num_attention_heads", heads, world_size)
    _require_divisible("ffn_hidden_size", config.ffn_hidden_size, world_size)
    head_dim = config.hidden_size // heads
    qkv: tuple[Segment, ...] | None = None
    if config.new_decoder_architecture:
        # [kv group][q heads of the group | k | v][head_dim]: whole groups per rank.
        _require_divisible("num_kv_heads", config.num_kv_heads, world_size)
    elif config.multi_query:
        qkv = (
            Segment(config.hidden_size),
            Segment(head_dim, sharded=False),
            Segment(head_dim, sharded=False),
        )
    return ShardPlan(
        rules=(
            ("*.self_attention.query_key_value", Column(segments=qkv)),
            ("*.self_attention.dense", Row()),
            ("*.mlp.dense_h_to_4h", Column()),
            ("*.mlp.dense_4h_to_h", Row()),
            ("transformer.word_embeddings", VocabEmbedding()),
            ("lm_head", VocabHead()),
        ),
        patch=_patch_falcon,
    )


# ---- t5: relative attention bias has one column per head ---------------------------------------------


def _patch_t5(model: nn.Module, config: Any, shard: Shard) -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    local = _local(config.num_heads, shard)
    for attention in _modules(model, T5Attention):
        attention.n_heads = local
        attention.inner_dim = local * attention.key_value_proj_dim


def _t5(config: Any, world_size: int) -> ShardPlan:
    _require_divisible("num_heads", config.num_heads, world_size)
    _require_divisible("d_ff", config.d_ff, world_size)
    return ShardPlan(
        rules=(
            ("*.SelfAttention.[qkv]", Column()),
            ("*.EncDecAttention.[qkv]", Column()),
            ("*.SelfAttention.o", Row()),
            ("*.EncDecAttention.o", Row()),
            ("*.SelfAttention.relative_attention_bias", SplitWeight(Split(dim=1))),
            ("*.DenseReluDense.wi", Column()),
            ("*.DenseReluDense.wi_[01]", Column()),
            ("*.DenseReluDense.wo", Row()),
            ("shared", VocabEmbedding()),
            ("*coder.embed_tokens", VocabEmbedding()),
            ("lm_head", VocabHead()),
        ),
        patch=_patch_t5,
    )


PLANS: dict[str, Callable[[Any, int], ShardPlan]] = {
    "llama": _llama,
    "mistral": _llama,
    "gpt_neox": _gpt_neox,
    "bloom": _bloom,
    "gpt2": _gpt2,
    "gpt_bigcode": _gpt_bigcode,
    "falcon": _falcon,
    "t5": _t5,
}


def plan_for(config: Any, world_size: int) -> ShardPlan:
    """The shard plan for this model config, or a startup error naming what is not supported."""
    factory = PLANS.get(config.model_type)
    if factory is None:
        supported = ", ".join(sorted(PLANS))
        raise UnsupportedShardingError(
            f"hf_custom_tp cannot shard model type {config.model_type} (supported: {supported})"
        )
    return factory(config, world_size)
