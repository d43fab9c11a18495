"""The engine boundary: what every engine takes (token ids) and gives back (next-token logits)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class EngineConfig:
    """How to load a model; resolved by the service before any engine is created."""

    model_path: Path
    dtype: str | None = None
    device: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    num_shards: int = 1  # tensor-parallel ranks (SPEC §9.3); engines without TP reject > 1
    master_addr: str = "localhost"  # torch.distributed rendezvous for num_shards > 1
    master_port: int = 29500  # 0 picks a free port
    cache_dir: Path | None = None  # where an engine may keep derived artefacts (ONNX exports)
    compile: bool = False  # PT2_COMPILE: torch.compile the forward (engines that run a torch model)
    paged: bool | None = None  # the paged step (engines.step): required, refused, or where supported
    cpu_bf16: bool = False  # with dtype unset on CPU: bfloat16 where the CPU runs it natively
    # Weights quantized at load (engines/quantized.py): None, "int8" or "int4" (groups of
    # quantize_group_size input features). A checkpoint quantized by others is read as it is.
    quantize: str | None = None
    quantize_group_size: int = 128
    kv_block_size: int | None = None  # the paged step's KV block size (None: its attention path's choice)


@dataclass(frozen=True)
class EngineSpec:
    """Facts about the loaded model that the service needs to drive it."""

    is_encoder_decoder: bool
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    device: torch.device
    dtype: torch.dtype
    model_config: dict[str, Any] = field(default_factory=dict)
    supports_prefixes: bool = True  # PrefillRow.prefix (SPEC §8 prompt tuning)
    supports_lora: bool = True  # PrefillRow.lora and unload_lora
    engine_name: str = "hf_transformers"  # the DEPLOYMENT_FRAMEWORK that loaded it (after any fallback)
    paged: bool = False  # runs `step` over KV blocks (engines.step.PagedEngine), not prefill/decode
    whole_graph_steps: bool = False  # PT2_COMPILE runs its steps as whole graphs (engines/compiled.py)


@dataclass(frozen=True)
class PrefixEmbeddings:
    """Prompt-tuning virtual tokens (SPEC §8), already in the model's dtype and on its device."""

    decoder: torch.Tensor | None = None  # [n, hidden]; decoder-only models need it
    encoder: torch.Tensor | None = None  # [m, hidden]; encoder-decoder models only

    def length(self, is_encoder_decoder: bool) -> int:
        """P of SPEC §8: decoder rows; encoder-decoder: encoder rows + (decoder rows + 1) if any."""
        decoder = 0 if self.decoder is None else int(self.decoder.shape[0])
        if not is_encoder_decoder:
            return decoder
        encoder = 0 if self.encoder is None else int(self.encoder.shape[0])
        return encoder + (decoder + 1 if decoder else 0)


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter directory (`adapter_config.json` + weights), identified by its store id."""

    adapter_id: str
    path: Path


@dataclass(frozen=True)
class PrefillRow:
    """A new sequence joining the running batch, with at most one adapter of either kind."""

    input_ids: Sequence[int]
    want_prompt_logits: bool = False
    prefix: PrefixEmbeddings | None = None
    lora: LoraAdapter | None = None


@dataclass
class PrefillResult:
    """Logits of the new rows, in the order they were given.

    A row's prompt logits cover its decoder prefix positions too (P + L rows, decoder-only)."""

    next_token_logits: torch.Tensor
    prompt_logits: list[torch.Tensor | None]


class AdapterUnavailableError(ValueError):
    """A row's adapter could not be loaded at batch time; the batch is unchanged, only its rows fail."""

    def __init__(self, adapter_id: str, reason: str) -> None:
        super().__init__(reason)
        self.adapter_id = adapter_id


class EngineFatalError(BaseException):
    """The engine can run no further step (a tensor-parallel rank died, a collective failed).

    A BaseException, so that per-request handlers (`except Exception`) let it through to the
    engine loop, whose crash stops the server instead of failing requests forever.
    """


class Engine(Protocol):
    """A running batch of sequences whose KV cache lives inside the engine.

    Rows are addressed by position: `prefill` appends rows at the end, `keep_rows` prunes, and
    `decode` takes one token per live row in row order. The caller mirrors that order.
    """

    spec: EngineSpec

    @property
    def num_rows(self) -> int: ...

    def prefill(self, rows: Sequence[PrefillRow]) -> PrefillResult: ...

    def decode(self, token_ids: Sequence[int]) -> torch.Tensor: ...

    def keep_rows(self, indices: Sequence[int]) -> None:
        """Lay the batch out as these rows, in this order: a row left out is dropped, a row named twice
        is copied with its cache (beam search continues one beam as several)."""
        ...

    def clear(self) -> None: ...

    def unload_lora(self, adapter_id: str) -> None:
        """Free a loaded LoRA adapter; deferred while a running row still uses it."""
        ...
