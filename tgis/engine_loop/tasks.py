"""A request inside the engine loop: its validated input (what the service core hands the loop), its id,
event sink and the times it passes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.base import LoraAdapter, PrefillRow, PrefixEmbeddings
from tgis.batching.admission import SequenceShape
from tgis.sampling.config import SamplingConfig
from tgis.types import GenerationEvent, GenerationParams

EventSink = Callable[[GenerationEvent], None]
Adapter = PrefixEmbeddings | LoraAdapter
_ids = itertools.count(1)


@dataclass(frozen=True)
class ValidatedInput:
    """One input, ready to queue: its ids after truncation, its adapter, and its own seed and token budget."""

    text: str
    input_ids: tuple[int, ...]
    params: GenerationParams
    seed: int
    max_new_tokens: int
    max_tokens_clamped: bool
    adapter: Adapter | None = None
    prefix_length: int = 0  # P of SPEC §8: virtual tokens the adapter adds before the input
    adapter_id: str | None = None  # the store id `adapter` was loaded from
    guide: object | None = None  # the compiled guided-decoding grammar (xgrammar.CompiledGrammar)
    # The per-step settings, built here so that a request the sampler cannot take fails validation
    # instead of reaching the engine loop.
    sampling: SamplingConfig = field(kw_only=True)

    @property
    def adapter_name(self) -> str | None:
        """The adapter's store id when the input uses one."""
        return self.adapter_id if self.adapter is not None else None

    def shape(self, generated: int = 0) -> SequenceShape:
        """Batch accounting: the prefix counts as input (SPEC §8), generated tokens as input so far."""
        length = len(self.input_ids) + self.prefix_length + generated
        return SequenceShape(length, self.max_new_tokens - generated)


@dataclass(eq=False)
class GenerationTask:
    """One validated input travelling from a front door to the loop; `cancelled` is set by the front door.

    `id` names the request everywhere behind the queue: runners, step results and outputs are keyed
    by it, and only a runner knows which tensor row holds it.

    `streamed` says whether the front door reads the events as they come. When it only folds them
    into one answer (a unary call), the loop holds them and hands them over with the last one: each
    hand-off wakes the asyncio thread, whose work then holds the GIL the next step needs.
    """

    input: ValidatedInput
    arrival: float
    sink: EventSink
    streamed: bool = True
    cancelled: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_ids), init=False)
    # Set by the loop thread before the event that reports them (for request logs and traces).
    admitted_at: float | None = None
    finished_at: float | None = None
    last_token_at: float | None = None  # its latest step with tokens (latency metrics)

    @property
    def deadline(self) -> float | None:
        millis = self.input.params.stopping.time_limit_millis
        return self.arrival + millis / 1000 if millis > 0 else None

    def shape(self, generated: int = 0) -> SequenceShape:
        return self.input.shape(generated)

    @property
    def lora(self) -> LoraAdapter | None:
        adapter = self.input.adapter
        return adapter if isinstance(adapter, LoraAdapter) else None

    @property
    def prefix(self) -> PrefixEmbeddings | None:
        adapter = self.input.adapter
        return adapter if isinstance(adapter, PrefixEmbeddings) else None

    @property
    def adapter_name(self) -> str | None:
        """The id the request named its adapter by (LoRA or prompt-tuning prefix), if any."""
        return self.input.adapter_name

    def prefill_row(self, want_prompt_logits: bool) -> PrefillRow:
        return PrefillRow(
            self.input.input_ids, want_prompt_logits=want_prompt_logits, prefix=self.prefix, lora=self.lora
        )
