"""The benchmark model shapes by name, and the transformers config each one builds (no weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

Family = Literal["gpt2", "llama"]
TokenizerKind = Literal["demo", "bpe32k"]


@dataclass(frozen=True)
class ShapeSpec:
    """Everything that determines a benchmark model but its seed; change a shape only together with its
    version, which names its cache directory (so reports made on an older build stay comparable)."""

    name: str
    family: Family
    layers: int
    hidden: int
    heads: int
    positions: int
    tokenizer: TokenizerKind
    saved_dtype: Literal["float32", "bfloat16"]
    about: str
    kv_heads: int | None = None  # llama: grouped-query attention
    intermediate: int | None = None  # llama: the gated MLP's width
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    version: str = "v1"

    @property
    def dir_name(self) -> str:
        return f"bench-{self.name}-{self.version}"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES: dict[str, ShapeSpec] = {
    shape.name: shape
    for shape in (
        # GPT-2 small's layers, width and heads with the demo tokenizer's 2048-token vocabulary (87M
        # parameters, not GPT-2's 124M): the CPU benchmark's model since the first report.
        ShapeSpec(
            "gpt2-small",
            "gpt2",
            layers=12,
            hidden=768,
            heads=12,
            positions=1024,
            tokenizer="demo",
            saved_dtype="float32",
            about="GPT-2 small's layers, width and heads, the demo tokenizer's vocabulary",
        ),
        # TinyLlama 1.1B's dimensions: the GPU benchmark's model.
        ShapeSpec(
            "llama-1b",
            "llama",
            layers=22,
            hidden=2048,
            heads=32,
            kv_heads=4,
            intermediate=5632,
            positions=2048,
            tokenizer="bpe32k",
            saved_dtype="bfloat16",
            about="TinyLlama 1.1B's dimensions",
        ),
        # The same family at a size a CPU serves in a smoke run or a test (about 21M parameters, most of
        # them the 32k-row embedding and output matrices).
        ShapeSpec(
            "llama-tiny",
            "llama",
            layers=6,
            hidden=256,
            heads=4,
            kv_heads=2,
            intermediate=768,
            positions=2048,
            tokenizer="bpe32k",
            saved_dtype="bfloat16",
            about="the llama family at smoke-test size",
        ),
    )
}
DEFAULT_SHAPE = "gpt2-small"


def shape_named(name: str) -> ShapeSpec:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)}") from None


def model_config(shape: ShapeSpec, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The shape's config, its vocabulary and special-token ids from `tokenizer`."""
    if shape.family == "gpt2":
        return _gpt2_config(shape, tokenizer)
    return _llama_config(shape, tokenizer)


def _gpt2_config(shape: ShapeSpec, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    from transformers import GPT2Config

    eos = tokenizer.eos_token_id
    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=shape.positions,
        n_embd=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def _llama_config(shape: ShapeSpec, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    from transformers import LlamaConfig

    if shape.intermediate is None or shape.kv_heads is None:
        raise ValueError(f"the llama shape {shape.name} needs its MLP width and key/value heads")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.positions,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=False,  # as TinyLlama: the output matrix is its own 32000 × hidden
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=shape.saved_dtype,
    )
