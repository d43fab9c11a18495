"""The paged engine's load-time checks: the key shape every attention layer reports, and a short
sequence through the paged step (in blocks of the serving size, through the attention path that will
serve) against the model's own forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import transformers

from engines.base import EngineSpec
from engines.paged import forward
from engines.quantized import is_quantized
from engines.step import KVCacheShape, SequenceChunk, StepBatch

if TYPE_CHECKING:
    from engines.paged.engine import PagedHFEngine

# A prompt in two chunks then two decode steps must give the logits of a plain forward, within this
# share of the logits' magnitude (a wrong mask or position is O(1)).
SELF_TEST_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 5e-2}
# Quantized layers round their activations to int8 per row (engines/quantized.py). Where the paged step's
# attention sums in another order than the model's own, a value at a rounding boundary moves a level,
# 1/127 of its row's peak, and the logits about as much: a float32 int8 model of the step profile's thin
# twin read 0.0086 (against float32's 1e-3) on one test run in CI and then served padded batches. A wrong
# attention (other positions, another sequence's keys) moves them by far more.
QUANTIZED_TOLERANCE = 3e-2
SELF_TEST_TOKENS = 11  # beyond one block: a prompt split in two chunks, then two decode steps


class UnevenLayersError(ValueError):
    """The attention layers report different key shapes (or some report none)."""


def discover_kv_shape(model: transformers.PreTrainedModel, spec: EngineSpec) -> KVCacheShape:
    """Run a 2-token forward that records each attention layer's key shape (GQA, MQA, head size)."""
    found: dict[int, tuple[int, int]] = {}
    empty = torch.empty(0, dtype=torch.long)
    context = forward.StepContext([], [], empty, 0, discovered=found)
    ids = torch.tensor([[1, 2]], device=spec.device)
    with torch.inference_mode():
        model(
            input_ids=ids,
            position_ids=torch.arange(2, device=spec.device)[None],
            use_cache=False,
            **{forward.CONTEXT_KWARG: context},
        )
    layers = int(getattr(model.config.get_text_config(), "num_hidden_layers", len(found)))
    if sorted(found) != list(range(layers)) or len(set(found.values())) != 1:
        raise UnevenLayersError(f"attention layers report uneven or missing key shapes: {found}")
    kv_heads, head_dim = next(iter(found.values()))
    return KVCacheShape(layers, kv_heads, head_dim, torch.tensor([], dtype=spec.dtype).element_size())


def self_test_tokens(model: transformers.PreTrainedModel, block_size: int) -> int:
    """Enough tokens to cross a block boundary at the serving block size, within the model's positions."""
    text = model.config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 4096
    return max(SELF_TEST_TOKENS, min(block_size + SELF_TEST_TOKENS, int(limit)))


def run(engine: PagedHFEngine, reference: torch.Tensor, token_ids: Sequence[int]) -> float:
    """Run `token_ids` as two prompt chunks then decode steps, in blocks of the serving size through the
    serving attention path; the largest deviation from `reference` (plain forward logits [len, V]) as a
    share of its magnitude."""
    size = engine.preferred_block_size
    blocks = tuple(range(-(-len(token_ids) // size)))
    engine.allocate(len(blocks), size)
    split, prompt_end = 5, len(token_ids) - 2
    steps = [
        StepBatch(prefill=(SequenceChunk(tuple(token_ids[:split]), 0, blocks, all_logits=True),)),
        StepBatch(
            prefill=(SequenceChunk(tuple(token_ids[split:prompt_end]), split, blocks, all_logits=True),)
        ),
        *(
            StepBatch(decode=(SequenceChunk((token_ids[p],), p, blocks, all_logits=True),))
            for p in range(prompt_end, len(token_ids))
        ),
    ]
    paged = torch.cat([engine.step(step).logits for step in steps])  # one chunk, every position's
    engine.allocate(0, size)
    return float((paged - reference).abs().max() / reference.abs().max().clamp(min=1e-6))


def failure(
    engine: PagedHFEngine, model: transformers.PreTrainedModel, spec: EngineSpec, plain: str
) -> str | None:
    """Why the engine's paged step does not give the logits of the model's own attention (`plain`)
    (None: it does)."""
    generator = torch.Generator().manual_seed(0)
    count = self_test_tokens(model, engine.preferred_block_size)
    token_ids = torch.randint(0, spec.vocab_size, (count,), generator=generator).tolist()
    model.set_attn_implementation(plain)
    try:
        with torch.inference_mode():
            ids = torch.tensor([token_ids], device=spec.device)
            reference = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(forward.ATTENTION_NAME)
    try:
        deviation = run(engine, reference, token_ids)
    except Exception as exc:
        if not engine.attention.path.varlen:
            raise
        return f"it raised {exc}"
    tolerance = SELF_TEST_TOLERANCE.get(spec.dtype, 5e-2)
    if any(is_quantized(module) for module in model.modules()):
        tolerance = max(tolerance, QUANTIZED_TOLERANCE)
    if deviation > tolerance:
        return (
            f"the paged step's logits deviate by {deviation:.2g} of their magnitude (tolerance {tolerance})"
        )
    return None
