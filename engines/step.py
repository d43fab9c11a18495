"""The contract of one paged engine step: which positions of which sequences to compute (no torch here).

The service plans a step (tgis.batching.paged) and hands the engine a `StepBatch`; the engine runs one
forward over all of its tokens, written into and read from the KV blocks each chunk names, and returns
logits only for the positions the service asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from engines.base import EngineSpec, LoraAdapter, PrefixEmbeddings


@dataclass(frozen=True)
class SequenceChunk:
    """Consecutive positions `start ..` of one sequence, with `token_ids[i]` at position start + i.

    A prompt-tuning prefix occupies positions 0 .. P-1 (its slots carry any id; the engine writes
    the prefix embeddings there). `block_table` lists the sequence's KV blocks in position order,
    covering at least every position up to the chunk's end.
    """

    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    sample: bool = False  # return the logits of the chunk's last position (it picks the next token)
    all_logits: bool = False  # return the logits of every position of the chunk (input token details)
    prefix: PrefixEmbeddings | None = None
    lora: LoraAdapter | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepBatch:
    """One forward pass: single-token chunks of decoding sequences first, then prompt chunks."""

    decode: tuple[SequenceChunk, ...] = ()
    prefill: tuple[SequenceChunk, ...] = ()
    hidden: bool = False  # also return the final hidden state (the LM head's input) of every logit row

    @property
    def chunks(self) -> tuple[SequenceChunk, ...]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


@dataclass
class StepOutput:
    """`logits` [rows, V] float32 holds every position's logits the step kept, and `chunk_rows[i]` the
    i-th chunk's rows of it: all its positions' if it asked for all logits, else its last one's if it
    samples, else none. With `StepBatch.hidden`, `hidden` [rows, H] holds the final hidden states of
    the same rows (a speculator reads them), in the model's dtype.

    The rows stay one tensor so that a caller picks every sequence's in one indexing call: a tensor
    call per sequence costs more than the arithmetic, and each may wait for the GIL."""

    logits: torch.Tensor
    chunk_rows: list[range]
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class KVCacheShape:
    """The engine's KV block geometry, for sizing the pool."""

    num_layers: int
    num_kv_heads: int  # per rank under tensor parallelism
    head_dim: int
    dtype_bytes: int

    def bytes_per_block(self, block_size: int) -> int:
        """Keys and values of `block_size` positions in every layer."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes


class PagedEngine(Protocol):
    """An engine that runs flat steps over KV blocks the service assigns (tgis.batching.paged)."""

    spec: EngineSpec
    kv_shape: KVCacheShape

    @property
    def preferred_block_size(self) -> int:
        """The KV block size to allocate: KV_BLOCK_SIZE when set, else what the attention path chose."""
        ...

    @property
    def attention_path(self) -> str:
        """How the step's layers attend (engines.paged.step_context.AttentionPath's names)."""
        ...

    @property
    def attention_fallback(self) -> str | None:
        """Why a faster attention path does not serve (None: the fastest this device offers does)."""
        ...

    def workspace_bytes(self, positions: int) -> int:
        """Device memory beyond the pool a step attending `positions` cached positions needs."""
        ...

    @property
    def graphs_captured(self) -> int:
        """Decode-step CUDA graphs captured (0: none)."""
        ...

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Create the KV blocks; every step's block tables index into them."""
        ...

    def step(self, batch: StepBatch) -> StepOutput: ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy every layer's keys and values of block `source` into block `target`, for each pair
        (a beam that branches off another gets its own copy of their shared, partly filled block)."""
        ...

    def load_lora(self, adapter: LoraAdapter) -> None:
        """Load a sequence's adapter before its first step (AdapterUnavailableError if it cannot)."""
        ...

    def unload_lora(self, adapter_id: str) -> None:
        """Delete an adapter no running sequence uses any more."""
        ...

    def capture_decode_graphs(self, max_positions: int, max_batch: int) -> str | None:
        """Capture CUDA graphs of decode-only steps (after `allocate`); returns why they are not used."""
        ...

    def export_fused_steps(self) -> str | None:
        """PT2_COMPILE on the CPU: compile the fused step ahead of time (after `allocate`); returns why it
        does not serve."""
        ...
