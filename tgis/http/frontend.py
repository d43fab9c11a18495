"""The HTTP routes' path into the engine: adapter → tokenize → validate → permits → EngineLoop, as gRPC does.

Both HTTP APIs (OpenAI, TGI) build GenerationParams themselves, then hand prompts here; this module
uses the same validation functions, the same permits pool, the same loop, metrics, request log and
tracing as the gRPC servicer, and yields the loop's events back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tgis.adapters.store import AdapterLoadError
from tgis.api.validation import Adapter, ValidatedInput
from tgis.errors import GenerationError, Msg, ValidationError
from tgis.openmp import run_torch_work
from tgis.server.servicer import ServiceContext, Submitted
from tgis.types import (
    FailureEvent,
    GenerationParams,
    InputTokensEvent,
    TokenEvent,
    TokenInfo,
)

Prompt = str | Sequence[int]


class ModelNotFoundError(ValidationError):
    """The request's `model` names neither the served model nor a loadable adapter (HTTP 404)."""


@dataclass
class Outcome:
    """One input's finished generation, folded from its events."""

    validated: ValidatedInput
    events: list[TokenEvent] = field(default_factory=list)
    input_tokens: tuple[TokenInfo, ...] = ()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def final(self) -> TokenEvent:
        return self.events[-1] if self.events else TokenEvent(generated_token_count=0, text="")

    @property
    def tokens(self) -> list[TokenInfo]:
        return [e.token for e in self.events if e.token is not None]


class Frontend:
    """Shared by the HTTP routes; one per server, over the gRPC side's ServiceContext."""

    def __init__(self, ctx: ServiceContext, served_model: str) -> None:
        self.ctx = ctx
        self.served_model = served_model

    async def adapter_for_model(self, model: str | None) -> tuple[Adapter | None, str | None]:
        """`model` as vLLM reads it: the served model (or nothing) → base; otherwise an adapter id."""
        if not model or model == self.served_model:
            return None, None
        store = self.ctx.adapters
        if store is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        try:
            adapter = await run_torch_work(lambda: store.get(model), name="adapter-load")
        except AdapterLoadError as exc:
            raise ModelNotFoundError(Msg.PREFIX_LOOKUP.format(id=model, reason=exc.reason)) from exc
        return self.ctx.supported_adapter(adapter, model), model

    async def encode(self, text: str, *, special_tokens: bool = True) -> tuple[int, ...]:
        tokenizer = self.ctx.tokenizer
        loop = asyncio.get_running_loop()

        def run() -> tuple[int, ...]:
            if special_tokens:
                return tokenizer.encode(text).ids
            return tuple(tokenizer.hf(text, add_special_tokens=False)["input_ids"])

        try:
            return await loop.run_in_executor(self.ctx.tokenization_executor, run)
        except Exception as exc:
            raise ValidationError(Msg.TOKENIZER.format(error=exc)) from exc

    async def validate(
        self,
        prompts: Sequence[Prompt],
        params: GenerationParams,
        adapter: Adapter | None,
        adapter_id: str | None,
        *,
        special_tokens: bool = True,
        guide: object = None,
    ) -> list[ValidatedInput]:
        """SPEC §3.1 #15–#16 per prompt; token-id prompts skip the tokenizer (checked against the vocab)."""
        started = time.monotonic()
        vocab = self.ctx.spec.vocab_size
        validated = []
        for prompt in prompts:
            if isinstance(prompt, str):
                text, ids = prompt, await self.encode(prompt, special_tokens=special_tokens)
            else:
                ids = tuple(prompt)
                if any(not 0 <= i < vocab for i in ids):
                    raise ValidationError(f"token ids must be in [0, {vocab})")
                text = self.ctx.tokenizer.decode(ids)
            validated.append(
                self.ctx.validated_input(
                    text, ids, params, adapter=adapter, adapter_id=adapter_id, guide=guide
                )
            )
        self.ctx.observe_validated(validated, started)
        return validated

    async def events(self, submitted: Submitted) -> AsyncIterator[InputTokensEvent | TokenEvent]:
        """The input's events until its last token; a failure raises GenerationError."""
        while True:
            event = await submitted.events.get()
            if isinstance(event, FailureEvent):
                raise GenerationError(event.message)
            yield event
            if isinstance(event, TokenEvent) and event.finished:
                return

    async def collect(self, submitted: Submitted) -> Outcome:
        outcome = Outcome(submitted.task.input)
        async for event in self.events(submitted):
            if isinstance(event, InputTokensEvent):
                outcome.input_tokens = event.tokens
            else:
                outcome.events.append(event)
        return outcome
