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


# ---- gpt2: Conv1D layers, c_attn laid out [q | k | v] ------------------------------------------------


def _patch_gpt2(model: nn.Module, config: Any, shard: Shard) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    local = _local(config.n_head, shard)
    for attention in _modules(model, GPT2Attention):
        attention.num_heads = local
        attention.embed_dim = local * attention.head_dim
        attention.split_size = attention.embed_dim


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


# ---- t5: relative attention bias has one column per head ---------------------------------------------


def _patch_t5(model: nn.Module, config: Any, shard: Shard) -> None:
    from transformers.models.t5.modeling_t5 import T5Attention

    local = _local(config.num_heads, shard)
    for attention in _modules(model, T5Attention):
        attention.n_heads = local
        attention.inner_dim = local * attention.key_value_proj_dim


# ---- the table: each family's layout by role -----------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One model family: the config counts that must split evenly, its module names by role (fnmatch
    patterns: the first that matches a module wins), and what to patch after sharding. Attention input
    projections and MLP input layers split by column, their outputs by row; embeddings and the LM head
    by vocabulary. Families whose attention reshapes with -1 heads (llama, gpt_neox) need no patch."""

    counts: Callable[[Any], dict[str, int]]
    attention_in: tuple[str, ...]
    attention_out: tuple[str, ...]
    mlp_in: tuple[str, ...]
    mlp_out: tuple[str, ...]
    embeddings: tuple[str, ...]
    head: str = "lm_head"
    conv1d: bool = False  # GPT-2's Conv1D layers
    fused_qkv: Callable[[Any], tuple[Segment, ...] | None] = lambda config: None
    refuse: Callable[[Any], str | None] = lambda config: None  # why a config cannot be sharded
    extra: tuple[tuple[str, Rule], ...] = ()
    patch: Patch | None = None

    def plan(self, config: Any, world_size: int) -> ShardPlan:
        refusal = self.refuse(config)
        if refusal is not None:
            raise UnsupportedShardingError(f"hf_custom_tp: {refusal} is not supported")
        for what, count in self.counts(config).items():
            _require_divisible(what, count, world_size)
        qkv = self.fused_qkv(config)
        rules: list[tuple[str, Rule]] = [
            *((p, Column(segments=qkv, conv1d=self.conv1d)) for p in self.attention_in),
            *((p, Row(conv1d=self.conv1d)) for p in self.attention_out),
            *self.extra,
            *((p, Column(conv1d=self.conv1d)) for p in self.mlp_in),
            *((p, Row(conv1d=self.conv1d)) for p in self.mlp_out),
            *((p, VocabEmbedding()) for p in self.embeddings),
            (self.head, VocabHead()),
        ]
        return ShardPlan(rules=tuple(rules), patch=self.patch)


def _counts(*names: str) -> Callable[[Any], dict[str, int]]:
    return lambda config: {name: getattr(config, name) for name in names}


def _gpt2_counts(config: Any) -> dict[str, int]:
    return {"n_head": config.n_head, "n_inner": config.n_inner or 4 * config.n_embd}


def _falcon_counts(config: Any) -> dict[str, int]:
    counts = {"num_attention_heads": config.num_attention_heads, "ffn_hidden_size": config.ffn_hidden_size}
    if config.new_decoder_architecture:  # [kv group][q heads of the group | k | v]: whole groups per rank
        counts["num_kv_heads"] = config.num_kv_heads
    return counts


def _multi_query_qkv(hidden: int, heads: int) -> tuple[Segment, ...]:
    """[q of every head | one k | one v]: the single key/value head stays whole on every rank."""
    head_dim = hidden // heads
    return (Segment(hidden), Segment(head_dim, sharded=False), Segment(head_dim, sharded=False))


def _cross_attention(config: Any) -> str | None:
    return (
        f"{config.model_type} with cross-attention" if getattr(config, "add_cross_attention", False) else None
    )


LLAMA = Layout(
    counts=_counts("num_attention_heads", "num_key_value_heads", "intermediate_size"),
    attention_in=("*.self_attn.[qkv]_proj",),
    attention_out=("*.self_attn.o_proj",),
    mlp_in=("*.mlp.gate_proj", "*.mlp.up_proj"),
    mlp_out=("*.mlp.down_proj",),
    embeddings=("model.embed_tokens",),
)
LAYOUTS: dict[str, Layout] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    # query_key_value is laid out [head][q|k|v][head_dim], so a contiguous split keeps whole heads.
    "gpt_neox": Layout(
        counts=_counts("num_attention_heads", "intermediate_size"),
        attention_in=("*.attention.query_key_value",),
        attention_out=("*.attention.dense",),
        mlp_in=("*.mlp.dense_h_to_4h",),
        mlp_out=("*.mlp.dense_4h_to_h",),
        embeddings=("gpt_neox.embed_in",),
        head="embed_out",
    ),
    # Fused [head][q|k|v] layout; ALiBi slopes per head.
    "bloom": Layout(
        counts=_counts("n_head"),
        attention_in=("*.self_attention.query_key_value",),
        attention_out=("*.self_attention.dense",),
        mlp_in=("*.mlp.dense_h_to_4h",),
        mlp_out=("*.mlp.dense_4h_to_h",),
        embeddings=("transformer.word_embeddings",),
        patch=_patch_bloom,
    ),
    # Conv1D layers; c_attn laid out [q | k | v].
    "gpt2": Layout(
        counts=_gpt2_counts,
        attention_in=("*.attn.c_attn",),
        attention_out=("*.attn.c_proj",),
        mlp_in=("*.mlp.c_fc",),
        mlp_out=("*.mlp.c_proj",),
        embeddings=("transformer.wte",),
        conv1d=True,
        fused_qkv=lambda config: tuple(Segment(config.n_embd) for _ in range(3)),
        refuse=_cross_attention,
        patch=_patch_gpt2,
    ),
    # Multi-query keeps its single key/value head on every rank; else [head][q|k|v][head_dim].
    "gpt_bigcode": Layout(
        counts=_gpt2_counts,
        attention_in=("*.attn.c_attn",),
        attention_out=("*.attn.c_proj",),
        mlp_in=("*.mlp.c_fc",),
        mlp_out=("*.mlp.c_proj",),
        embeddings=("transformer.wte",),
        fused_qkv=lambda config: (
            _multi_query_qkv(config.n_embd, config.n_head) if config.multi_query else None
        ),
        refuse=_cross_attention,
        patch=_patch_bigcode,
    ),
    # Three fused query_key_value layouts: grouped (new decoder architecture), multi-query, per head.
    "falcon": Layout(
        counts=_falcon_counts,
        attention_in=("*.self_attention.query_key_value",),
        attention_out=("*.self_attention.dense",),
        mlp_in=("*.mlp.dense_h_to_4h",),
        mlp_out=("*.mlp.dense_4h_to_h",),
        embeddings=("transformer.word_embeddings",),
        fused_qkv=lambda config: (
            _multi_query_qkv(config.hidden_size, config.num_attention_heads)
            if config.multi_query and not config.new_decoder_architecture
            else None
        ),
        refuse=lambda config: "falcon with ALiBi" if config.alibi else None,
        patch=_patch_falcon,
    ),
    # The relative attention bias has one column per head.
    "t5": Layout(
        counts=_counts("num_heads", "d_ff"),
        attention_in=("*.SelfAttention.[qkv]", "*.EncDecAttention.[qkv]"),
        attention_out=("*.SelfAttention.o", "*.EncDecAttention.o"),
        mlp_in=("*.DenseReluDense.wi", "*.DenseReluDense.wi_[01]"),
        mlp_out=("*.DenseReluDense.wo",),
        embeddings=("shared", "*coder.embed_tokens"),
        extra=(("*.SelfAttention.relative_attention_bias", SplitWeight(Split(dim=1))),),
        patch=_patch_t5,
    ),
}


def plan_for(config: Any, world_size: int) -> ShardPlan:
    """The shard plan for this model config, or a startup error naming what is not supported."""
    layout = LAYOUTS.get(config.model_type)
    if layout is None:
        supported = ", ".join(sorted(LAYOUTS))
        raise UnsupportedShardingError(
            f"hf_custom_tp cannot shard model type {config.model_type} (supported: {supported})"
        )
    return layout.plan(config, world_size)
