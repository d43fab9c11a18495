"""A transformers decoder-only model run one flat, paged step at a time (`PagedHFEngine`).

The model itself is unmodified: its attention layers run through the function registered in
engines/paged/forward.py. Each step's tokens (decode tokens first, then prompt chunks) form one
[1, T] row with their own position ids; the engine holds the KV blocks and returns the logits of
the positions the step asks for. Prompt-tuning prefixes enter as input embeddings over their
positions; LoRA adapters mix per token (engines/lora.py's flat mode).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, cast

import torch
import transformers

from engines.base import EngineSpec, LoraAdapter
from engines.common import lm_head_inputs
from engines.compiled import CompiledForward
from engines.lora import LoraAdapters
from engines.paged import forward, graphs, paths, ragged, self_test, step_context, step_inputs, varlen
from engines.paged.exported_step import ExportedFusedStep, export_fused_step
from engines.paged.graphs import DecodeGraphs
from engines.paged.staging import Staging
from engines.paged.step_context import AttentionPath
from engines.step import KVCacheShape, SequenceChunk, StepBatch, StepOutput


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

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        spec: EngineSpec,
        kv_shape: KVCacheShape,
        block_size: int | None = None,
    ):
        self.model = model
        self.spec = spec
        self.kv_shape = kv_shape
        self.block_size = 0
        self.num_blocks = 0
        self._key_caches: list[torch.Tensor] = []
        self._value_caches: list[torch.Tensor] = []
        self._loras: LoraAdapters | None = None
        self._staging = Staging(spec.device)
        self._graphs: DecodeGraphs | None = None
        self._graph_logits: torch.Tensor | None = None  # [largest bucket, V] float32, every graph's output
        self._workspace: ragged.Workspace | None = None  # gathered keys: held for the graphs, reused eagerly
        self._exported: ExportedFusedStep | None = None  # PT2_COMPILE's decode steps, over this pool's caches
        self.attention = paths.choose(spec.device, self._geometry(), block_size)

    # ---- setup -----------------------------------------------------------------------------------

    @property
    def preferred_block_size(self) -> int:
        """The KV block size the attention path chose (KV_BLOCK_SIZE when set)."""
        return self.attention.block_size

    @property
    def attention_path(self) -> str:
        return str(self.attention.path)

    @property
    def attention_fallback(self) -> str | None:
        return self.attention.fallback

    def workspace_bytes(self, positions: int) -> int:
        """Device memory a step attending `positions` cached positions needs beyond the pool (the gathered
        keys and values of one layer)."""
        if self.attention.path is not AttentionPath.VARLEN_GATHERED:
            return 0
        shape = self.kv_shape
        return positions * ragged.Workspace.bytes_per_position(
            shape.num_kv_heads, shape.head_dim, shape.dtype_bytes
        )

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Create (or replace) the KV blocks: every layer's keys and values for num_blocks × block_size.

        On the varlen paths one more block, which no sequence is ever given, takes the padding rows of
        decode graphs."""
        self._key_caches, self._value_caches = [], []  # the old pool goes first
        self._graphs = self._graph_logits = self._workspace = self._exported = None
        if block_size != self.attention.block_size:
            self.attention = paths.choose(self.spec.device, self._geometry(), block_size)
        physical = num_blocks + 1 if self.attention.path.varlen and num_blocks else num_blocks
        shape = (physical, block_size, self.kv_shape.num_kv_heads, self.kv_shape.head_dim)
        device, dtype = self.spec.device, self.spec.dtype
        for _ in range(self.kv_shape.num_layers):
            self._key_caches.append(torch.zeros(shape, dtype=dtype, device=device))
            self._value_caches.append(torch.zeros(shape, dtype=dtype, device=device))
        for cache in (*self._key_caches, *self._value_caches):
            # Fixed until the next allocate: a compiled step bakes its shape in instead of checking
            # ~170 symbolic relations between the caches' sizes in Python before every step
            # (engines/compiled.py).
            torch._dynamo.mark_static(cache)
        self.num_blocks, self.block_size = num_blocks, block_size

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Every layer's keys and values of each pair's source block, copied into its target block."""
        if not pairs:
            return
        device = self.spec.device
        sources = torch.tensor([source for source, _ in pairs], dtype=torch.long, device=device)
        targets = torch.tensor([target for _, target in pairs], dtype=torch.long, device=device)
        for cache in (*self._key_caches, *self._value_caches):
            cache.index_copy_(0, targets, cache.index_select(0, sources))

    def use_attention(self, choice: paths.AttentionChoice) -> None:
        """Serve with this path (tests run the CUDA paths on the CPU with the kernel's torch stand-in)."""
        self.attention = choice
        self._graphs = self._graph_logits = self._workspace = self._exported = None

    def _geometry(self) -> paths.Geometry:
        text = self.model.config.get_text_config()
        return paths.Geometry(
            heads=int(text.num_attention_heads),
            kv_heads=self.kv_shape.num_kv_heads,
            head_dim=self.kv_shape.head_dim,
            dtype=self.spec.dtype,
            windowed=bool(getattr(text, "sliding_window", None)),
        )

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

    @property
    def graph_replays(self) -> int:
        """Decode steps served by a replayed CUDA graph so far."""
        return 0 if self._graphs is None else self._graphs.replays

    @property
    def graphs_captured(self) -> int:
        return 0 if self._graphs is None else self._graphs.captured

    def capture_decode_graphs(self, max_positions: int, max_batch: int) -> str | None:
        """Capture CUDA graphs of decode steps of up to `max_batch` sequences of up to `max_positions`
        positions; returns why they are not used (None: they are). Call after `allocate`."""
        if self.spec.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if not self.attention.path.varlen:
            return f"decode graphs run the varlen kernel, and attention runs {self.attention.path}"
        prepared = self.prepare_decode_graphs(max_positions, max_batch)
        try:
            with torch.inference_mode():
                prepared.capture(self._graph_forward, self.spec.device, self._staging)
        except Exception as exc:  # capture refuses some models' ops (a host sync, a CPU tensor)
            self._graph_logits = self._workspace = None
            return f"capture failed: {exc}"
        self._graphs = prepared
        return None

    def prepare_decode_graphs(self, max_positions: int, max_batch: int) -> DecodeGraphs:
        """The graphs' plan and the buffers they share (their output and, for gathered keys, the
        workspace), before capture; `graph_forward` runs what a graph captures."""
        width = -(-max_positions // self.block_size)
        buckets = graphs.buckets_up_to(max_batch)
        tiers_of = None
        if self.attention.path is AttentionPath.VARLEN_GATHERED:
            capacity = min(max_batch * max_positions, self.num_blocks * self.block_size + max_batch)
            self._workspace = ragged.Workspace.empty(capacity, self._key_caches[0])
            tiers_of = functools.partial(graphs.tiers, max_positions=max_positions, capacity=capacity)
        vocab, device = self.spec.vocab_size, self.spec.device
        self._graph_logits = torch.empty(max(buckets), vocab, dtype=torch.float32, device=device)
        return graphs.DecodeGraphs(self.block_size, width, self.num_blocks, buckets, tiers_of)

    def graph_forward(self, inputs: graphs.DecodeInputs, tier: int | None) -> torch.Tensor:
        """What a decode graph of `prepare_decode_graphs` runs, eagerly (tests check it on the CPU)."""
        with torch.inference_mode():
            return self._graph_forward(inputs, tier)

    def _graph_forward(self, inputs: graphs.DecodeInputs, tier: int | None) -> torch.Tensor:
        """A decode step over static buffers (what a graph captures): its logits written into the rows of
        the one output buffer every graph shares."""
        bucket, device = len(inputs.token_ids), self.spec.device
        layout = ragged.RaggedLayout(
            kernel=self.attention.kernel or varlen.flash_varlen,
            cu_seq_q=torch.arange(bucket + 1, dtype=torch.int32, device=device),
            block_table=inputs.block_tables,
            max_q=1,
            max_k=inputs.block_tables.shape[1] * self.block_size,
            causal=False,
            seqused_k=None if tier else inputs.key_lengths,
            cu_seq_k=inputs.key_lengths if tier else None,
        )
        if tier:
            assert self._workspace is not None
            scratch = self.num_blocks * self.block_size
            gather = ragged.gather_slots(
                inputs.key_lengths, inputs.block_tables, self.block_size, tier, scratch
            )
            layout = ragged.RaggedLayout(**{**vars(layout), "gather": gather, "workspace": self._workspace})
        context = forward.StepContext(
            self._key_caches, self._value_caches, inputs.slots, bucket, ragged=layout
        )
        keep = torch.arange(bucket, device=device)
        out = self.model(
            input_ids=inputs.token_ids[None],
            position_ids=inputs.positions[None],
            use_cache=False,
            logits_to_keep=keep,
            **{forward.CONTEXT_KWARG: context},
        )
        assert self._graph_logits is not None
        return self._graph_logits[:bucket].copy_(out.logits[0])

    @property
    def exported_steps(self) -> int:
        """Steps served by the exported fused step so far."""
        return 0 if self._exported is None else self._exported.steps

    def export_fused_steps(self) -> str | None:
        """PT2_COMPILE on the CPU: export the fused step and compile it ahead of time
        (engines/paged/exported_step.py), to serve decode steps that want no adapter or LM-head inputs
        (`_exported_covers`); returns why it does not serve (None: it does). Call after `allocate`."""
        compiled = self.model.forward
        if not isinstance(compiled, CompiledForward) or not self.spec.whole_graph_steps:
            return "only PT2_COMPILE's whole-graph CPU steps are exported"
        size = self.block_size
        if self.num_blocks < 3:
            return "the pool has fewer than the 3 blocks the export's sample step takes"
        sample = StepBatch(  # 4 tokens, 2 rows kept, tables 2 blocks wide
            decode=(SequenceChunk((0,), size, (0, 1), sample=True),),
            prefill=(SequenceChunk((0, 0, 0), 0, (2,), sample=True),),
        )
        tensors = step_context.build(sample, self._builder())
        if not tensors.context.attends_fused:
            return f"the {self.attention.path} path does not fuse a step's layers"
        try:
            self._exported = export_fused_step(self.model, compiled.eager, tensors)
        except Exception as exc:  # an operator export or AOTInductor refuses: torch.compile serves on
            return f"export failed: {exc}"  # the caller logs it
        return None

    # ---- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> StepOutput:
        if self._graphs is not None and self._graph_logits is not None:
            replayed = self._graphs.run(batch, self._staging, self._graph_logits)
            if replayed is not None:
                return StepOutput(replayed, [range(row, row + 1) for row in range(len(batch.decode))])
        chunks = batch.chunks
        tensors = step_context.build(batch, self._builder())
        if self._exported is not None and self._exported_covers(batch, tensors):
            return StepOutput(self._exported(tensors).float(), tensors.rows)
        kwargs: dict[str, Any] = {
            "position_ids": tensors.positions[None],
            forward.CONTEXT_KWARG: tensors.context,
        }
        if step_context.prefix_chunks(chunks):
            kwargs["inputs_embeds"] = self._embeddings(tensors.input_ids, chunks)[None]
        else:
            kwargs["input_ids"] = tensors.input_ids[None]
        with self._adapters(chunks), self._lm_head_inputs(batch.hidden) as hidden_states:
            out = self.model(use_cache=False, logits_to_keep=tensors.keep, **kwargs)
        return StepOutput(out.logits[0].float(), tensors.rows, hidden_states[0][0] if batch.hidden else None)

    def _exported_covers(self, batch: StepBatch, tensors: step_context.StepTensors) -> bool:
        """Whether the exported fused step serves this step: decode tokens alone, fused, with no adapter
        and no LM-head inputs wanted. A fused step with prompt tokens stays with torch.compile: through
        the package it cost so much less than a step with a longer chunk (eager) that the prompt
        budget's line fitted neither, and in the long-prompt mix (int4, 16 streams, 2-core Zen 4) ITL p99
        came to 2.33x and 2.73x p50, against 1.49x and 1.80x with decode steps alone exported."""
        return (
            not batch.prefill and tensors.context.attends_fused and not batch.hidden and self._loras is None
        )

    def _builder(self) -> step_context.StepBuilder:
        return step_context.StepBuilder(
            self.attention.path,
            self.block_size,
            self._key_caches,
            self._value_caches,
            self._staging,
            self.attention.kernel,
            self._step_workspace,
        )

    def _step_workspace(self, positions: int) -> ragged.Workspace:
        """The graphs' workspace when it holds the step's keys, else one for this step alone."""
        if self._workspace is not None and self._workspace.positions >= positions:
            return self._workspace
        return ragged.Workspace.empty(positions, self._key_caches[0])

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


def build(
    model: transformers.PreTrainedModel, spec: EngineSpec, block_size: int | None = None
) -> PagedHFEngine:
    """Switch the model to the paged attention function and prove it right on a short sequence, at
    `block_size` (None: the attention path's choice) through the path that will serve; raises
    PagedUnsupportedError (the model is left as it was) when it cannot serve paged."""
    reason = paged_support(model)
    if reason is not None:
        raise PagedUnsupportedError(reason)
    previous = model.config._attn_implementation or "sdpa"
    forward.register()
    model.set_attn_implementation(forward.ATTENTION_NAME)
    try:
        engine = PagedHFEngine(model, spec, self_test.discover_kv_shape(model, spec), block_size)
        failure = self_test.failure(engine, model, spec, previous)
        if failure is not None and engine.attention.path.varlen:  # the torch path may still serve
            fallback = f"the {engine.attention.path} path failed the self-test ({failure})"
            size = engine.preferred_block_size
            engine.use_attention(paths.AttentionChoice(AttentionPath.PER_SEQUENCE, size, fallback=fallback))
            failure = self_test.failure(engine, model, spec, previous)
    except Exception as exc:
        model.set_attn_implementation(previous)
        raise PagedUnsupportedError(f"the paged step failed its self-test: {exc}") from exc
    if failure is not None:
        model.set_attn_implementation(previous)
        raise PagedUnsupportedError(failure)
    paths.log(engine.attention)
    return engine
