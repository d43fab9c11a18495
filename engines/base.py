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


@dataclass(frozen=True)
class PrefillRow:
    """A new sequence joining the running batch."""

    input_ids: Sequence[int]
    want_prompt_logits: bool = False


@dataclass
class PrefillResult:
    """Logits of the new rows, in the order they were given."""

    next_token_logits: torch.Tensor
    prompt_logits: list[torch.Tensor | None]


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

    def keep_rows(self, indices: Sequence[int]) -> None: ...

    def clear(self) -> None: ...
