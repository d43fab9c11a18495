"""A transformers decoder-only model run one flat, paged step at a time (`PagedHFEngine`).

The model itself is unmodified: its attention layers run through the function registered in
engines/paged/forward.py. Each step's tokens (decode tokens first, then prompt chunks) form one
[1, T] row with their own position ids; the engine holds the KV blocks and returns the logits of
the positions the step asks for. Prompt-tuning prefixes enter as input embeddings over their
positions; LoRA adapters mix per token (engines/lora.py's flat mode).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
import transformers

from engines.base import EngineSpec, LoraAdapter
from engines.common import lm_head_inputs
from engines.lora import LoraAdapters
from engines.paged import cpu_kernel, forward, graphs, ragged, step_inputs
from engines.paged.graphs import DecodeGraphs
from engines.step import KVCacheShape, SequenceChunk, StepBatch, StepOutput

logger = logging.getLogger(__name__)

# The load-time self-test: a prompt in two chunks then two decode steps must give the logits of a
# plain forward, within this share of the logits' magnitude (a wrong mask or position is O(1)).
SELF_TEST_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 5e-2}
SELF_TEST_TOKENS = 11
SELF_TEST_BLOCK_SIZE = 4


class PagedUnsupportedError(ValueError):
    """The model cannot run the paged step; the padded engine serves it instead."""


def paged_support(model: transformers.PreTrainedModel) -> str | None:
    """Why the model cannot run the paged step, or None if it can."""
    if model.config.is_encoder_decoder:
        return "encoder-decoder models keep cross-attention state the paged step does not hold"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{model.config.model_type} does not route attention through transformers' attention interface"
    return None


class PagedHFEngine:
    """One transformers model on one device, run over KV blocks the service assigns."""

    def __init__(self, model: transformers.PreTrainedModel, spec: EngineSpec, kv_shape: KVCacheShape):
        self.model = model
        self.spec = spec
        self.kv_shape = kv_shape
        self.block_size = 0
        self.num_blocks = 0
        self._key_caches: list[torch.Tensor] = []
        self._value_caches: list[torch.Tensor] = []
        self._loras: LoraAdapters | None = None
        self.ragged = False  # one varlen call per layer (CUDA), once allocate has probed the kernel
        self._graphs: DecodeGraphs | None = None

    # ---- setup -----------------------------------------------------------------------------------

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Create (or replace) the KV blocks: every layer's keys and values for num_blocks × block_size.

        On CUDA one more block, which no sequence is ever given, takes the padding rows of decode graphs."""
        self._key_caches, self._value_caches, self._graphs = [], [], None  # the old pool goes first
        physical = num_blocks + 1 if self.spec.device.type == "cuda" and num_blocks else num_blocks
        shape = (physical, block_size, self.kv_shape.num_kv_heads, self.kv_shape.head_dim)
        device, dtype = self.spec.device, self.spec.dtype
        for _ in range(self.kv_shape.num_layers):
            self._key_caches.append(torch.zeros(shape, dtype=dtype, device=device))
            self._value_caches.append(torch.zeros(shape, dtype=dtype, device=device))
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ragged = self._ragged_kernel_serves(block_size) if num_blocks else False

    def _ragged_kernel_serves(self, block_size: int) -> bool:
        if self.spec.device.type != "cuda":
            return False
        heads = int(self.model.config.get_text_config().num_attention_heads)
        shape = self.kv_shape
        reason = ragged.probe(
            block_size, shape.num_kv_heads, heads, shape.head_dim, self.spec.dtype, self.spec.device
        )
        if reason is None:
            logger.info(
                f"Paged attention: one varlen kernel call per layer (blocks of {block_size} positions)"
            )
        else:
            logger.info(f"Paged attention: per-sequence chunks ({reason})")
        return reason is None

    @property
    def loras(self) -> LoraAdapters | None:
        return self._loras

    def load_lora(self, adapter: LoraAdapter) -> None:
        """Load an adapter before its first step; raises AdapterUnavailableError (LoraLoadError)."""
        if not self.spec.supports_lora:
            raise ValueError("this engine does not serve LoRA adapters")
        if self._loras is None:
            self._loras = LoraAdapters(self.model, self.spec.device)
        self._loras.load(adapter)

    def unload_lora(self, adapter_id: str) -> None:
        """Delete the adapter now; the caller makes sure no running sequence uses it."""
        if self._loras is not None:
            self._loras.unload(adapter_id)

    def capture_decode_graphs(self, max_positions: int, max_batch: int) -> str | None:
        """Capture CUDA graphs of decode steps of up to `max_batch` sequences of up to `max_positions`
        positions; returns why they are not used (None: they are). Call after `allocate`."""
        if self.spec.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if not self.ragged:
            return "decode graphs run the varlen kernel, which this pool's geometry cannot use"
        width = -(-max_positions // self.block_size)
        buckets = [b for b in graphs.BUCKETS if b <= max_batch] or [1]
        captured = graphs.DecodeGraphs(self.block_size, width, self.num_blocks, buckets)
        try:
            with torch.inference_mode():
                captured.capture(self._graph_forward, self.spec.device)
        except Exception as exc:  # capture refuses some models' ops (a host sync, a CPU tensor)
            return f"capture failed: {exc}"
        self._graphs = captured
        return None

    def _graph_forward(self, inputs: graphs.DecodeInputs) -> torch.Tensor:
        """A decode step over static buffers (what a graph captures): logits [bucket, V] float32."""
        bucket, device = len(inputs.token_ids), self.spec.device
        width = inputs.block_tables.shape[1]
        layout = ragged.RaggedLayout(
            cu_seq_q=torch.arange(bucket + 1, dtype=torch.int32, device=device),
            seqused_k=inputs.seq_lens,
            block_table=inputs.block_tables,
            max_q=1,
            max_k=width * self.block_size,
        )
        empty = torch.empty(0, dtype=torch.long, device=device)
        context = forward.StepContext(
            key_caches=self._key_caches,
            value_caches=self._value_caches,
            slot_mapping=inputs.slots,
            num_decode=bucket,
            decode_block_tables=inputs.block_tables,
            decode_lengths=inputs.seq_lens,
            prefill_block_tables=empty,
            prefill_starts=empty,
            prefill_lengths=empty,
            prefill_contexts=empty,
            ragged=layout,
        )
        keep = torch.arange(bucket, device=device)
        out = self.model(
            input_ids=inputs.token_ids[None],
            position_ids=inputs.positions[None],
            use_cache=False,
            logits_to_keep=keep,
            **{forward.CONTEXT_KWARG: context},
        )
        return out.logits[0].float()

    # ---- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> StepOutput:
        if self._graphs is not None:
            replayed = self._graphs.run(batch)
            if replayed is not None:
                return StepOutput(replayed, [range(row, row + 1) for row in range(len(batch.decode))])
        device = self.spec.device
        chunks = batch.chunks
        ids = torch.tensor([t for chunk in chunks for t in chunk.token_ids], dtype=torch.long, device=device)
        positions = step_inputs.tensor([p for chunk in chunks for p in range(chunk.start, chunk.end)], device)
        context = self._context(batch)
        keep, where = step_inputs.logit_rows(chunks)
        kwargs: dict[str, Any] = {"position_ids": positions[None], forward.CONTEXT_KWARG: context}
        if any(
            chunk.prefix is not None and chunk.start < step_inputs.prefix_length(chunk) for chunk in chunks
        ):
            kwargs["inputs_embeds"] = self._embeddings(ids, chunks)[None]
        else:
            kwargs["input_ids"] = ids[None]
        with self._adapters(chunks), self._lm_head_inputs(batch.hidden) as hidden_states:
            out = self.model(
                use_cache=False, logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device), **kwargs
            )
        return StepOutput(out.logits[0].float(), where, hidden_states[0][0] if batch.hidden else None)

    def _context(self, batch: StepBatch) -> forward.StepContext:
        device, size = self.spec.device, self.block_size
        tables = [step_inputs.used_blocks(c, size) for c in batch.chunks]  # decode chunks first
        num_decode = len(batch.decode)
        decode_tables = step_inputs.block_tables(tables[:num_decode], device)
        prefill_tables = step_inputs.block_tables(tables[num_decode:], device)
        lengths = [len(chunk.token_ids) for chunk in batch.prefill]
        layout = (
            ragged.layout(
                [len(c.token_ids) for c in batch.chunks], [c.end for c in batch.chunks], tables, device
            )
            if self.ragged
            else None
        )
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        decode_lengths = step_inputs.tensor([c.end for c in batch.decode], device)
        shared_blocks = step_inputs.shared_prefix_blocks(batch.decode, size)
        fused = None
        kernel = cpu_kernel.decode_layer_kernel() if device.type == "cpu" and not shared_blocks else None
        if kernel is not None:
            token_tables = (
                step_inputs.per_token_tables(batch.chunks, tables, device)
                if batch.prefill
                else (decode_tables, decode_lengths)  # one token a sequence: the decode tables are per token
            )
            fused = None if token_tables is None else forward.FusedLayers(kernel, *token_tables)
        return forward.StepContext(
            key_caches=self._key_caches,
            value_caches=self._value_caches,
            slot_mapping=step_inputs.slots(batch.chunks, size, device),
            num_decode=num_decode,
            decode_block_tables=decode_tables,
            decode_lengths=decode_lengths,
            prefill_block_tables=prefill_tables,
            prefill_starts=step_inputs.tensor(starts, device),
            prefill_lengths=step_inputs.tensor(lengths, device),
            prefill_contexts=step_inputs.tensor([c.start for c in batch.prefill], device),
            decode_shared_blocks=shared_blocks,
            fused=fused,
            ragged=layout,
        )

    def _embeddings(self, ids: torch.Tensor, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        """Token embeddings with each chunk's prompt-tuning prefix written over its prefix positions."""
        embeds = cast(torch.Tensor, self.model.get_input_embeddings()(ids))
        offset = 0
        for chunk in chunks:
            prefix_end = step_inputs.prefix_length(chunk)
            if chunk.prefix is not None and chunk.prefix.decoder is not None and chunk.start < prefix_end:
                rows = min(prefix_end, chunk.end) - chunk.start
                virtual = chunk.prefix.decoder[chunk.start : chunk.start + rows]
                embeds[offset : offset + rows] = virtual.to(embeds.device, embeds.dtype)
            offset += len(chunk.token_ids)
        return embeds

    def _adapters(self, chunks: Sequence[SequenceChunk]):
        """peft's per-token adapter selection when LoRA adapters are loaded, else nothing."""

        if self._loras is None or not self._loras.wrapped:
            return contextlib.nullcontext()
        per_token = [
            None if chunk.lora is None else chunk.lora.adapter_id for chunk in chunks for _ in chunk.token_ids
        ]
        return self._loras.forward_context(per_token, flat=True)

    def _lm_head_inputs(self, wanted: bool) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """The LM head's inputs (the final hidden states of the kept rows, [1, rows, H]) when `wanted`."""
        return lm_head_inputs(self.model) if wanted else contextlib.nullcontext([])


# ---- building one -------------------------------------------------------------------------------


def discover_kv_shape(model: transformers.PreTrainedModel, spec: EngineSpec) -> KVCacheShape:
    """Run a 2-token forward that records each attention layer's key shape (GQA, MQA, head size)."""
    found: dict[int, tuple[int, int]] = {}
    context = forward.StepContext(
        key_caches=[],
        value_caches=[],
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decode=0,
        decode_block_tables=torch.empty(0),
        decode_lengths=torch.empty(0),
        prefill_block_tables=torch.empty(0),
        prefill_starts=torch.empty(0),
        prefill_lengths=torch.empty(0),
        prefill_contexts=torch.empty(0),
        discovered=found,
    )
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
        raise PagedUnsupportedError(f"attention layers report uneven or missing key shapes: {found}")
    kv_heads, head_dim = next(iter(found.values()))
    return KVCacheShape(layers, kv_heads, head_dim, torch.tensor([], dtype=spec.dtype).element_size())


def self_test(engine: PagedHFEngine, reference: torch.Tensor, token_ids: Sequence[int]) -> float:
    """Run `token_ids` as two prompt chunks then decode steps; the largest deviation from `reference`
    (plain forward logits [len, V]) as a share of its magnitude."""
    size = SELF_TEST_BLOCK_SIZE
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


def build(model: transformers.PreTrainedModel, spec: EngineSpec) -> PagedHFEngine:
    """Switch the model to the paged attention function and prove it right on a short sequence;
    raises PagedUnsupportedError (the model is left as it was) when it cannot serve paged."""
    reason = paged_support(model)
    if reason is not None:
        raise PagedUnsupportedError(reason)
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, spec.vocab_size, (SELF_TEST_TOKENS,), generator=generator).tolist()
    with torch.inference_mode():
        reference = model(input_ids=torch.tensor([token_ids], device=spec.device), use_cache=False).logits[0]
    previous = model.config._attn_implementation
    forward.register()
    model.set_attn_implementation(forward.ATTENTION_NAME)
    try:
        engine = PagedHFEngine(model, spec, discover_kv_shape(model, spec))
        deviation = self_test(engine, reference.float(), token_ids)
    except Exception as exc:
        model.set_attn_implementation(previous)
        raise PagedUnsupportedError(f"the paged step failed its self-test: {exc}") from exc
    tolerance = SELF_TEST_TOLERANCE.get(spec.dtype, 5e-2)
    if deviation > tolerance:
        model.set_attn_implementation(previous)
        raise PagedUnsupportedError(
            f"the paged step's logits deviate by {deviation:.2g} of their magnitude (tolerance {tolerance})"
        )
    return engine
