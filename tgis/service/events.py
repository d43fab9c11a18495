"""A submitted input's event stream, read by either front door: as it comes, or folded into an Outcome."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tgis.engine_loop.tasks import GenerationTask, ValidatedInput
from tgis.errors import GenerationError
from tgis.types import FailureEvent, GenerationEvent, InputTokensEvent, TokenEvent, TokenInfo


@dataclass
class Submitted:
    """One input in the engine loop; `events` receives its GenerationEvents from the loop thread."""

    task: GenerationTask
    events: asyncio.Queue[GenerationEvent]

    async def stream(self) -> AsyncIterator[InputTokensEvent | TokenEvent]:
        """The input's events until its last token; a failure raises GenerationError."""
        while True:
            event = await self.events.get()
            if isinstance(event, FailureEvent):
                raise GenerationError(event.message)
            yield event
            if isinstance(event, TokenEvent) and event.finished:
                return

    async def outcome(self) -> Outcome:
        """Every event of the input, folded."""
        outcome = Outcome(self.task.input)
        async for event in self.stream():
            outcome.add(event)
        return outcome


@dataclass
class Outcome:
    """One input's generation so far, folded from its events."""

    validated: ValidatedInput
    events: list[TokenEvent] = field(default_factory=list)
    input_tokens: tuple[TokenInfo, ...] = ()

    def add(self, event: InputTokensEvent | TokenEvent) -> None:
        if isinstance(event, InputTokensEvent):
            self.input_tokens = event.tokens
        else:
            self.events.append(event)

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def final(self) -> TokenEvent:
        return self.events[-1] if self.events else TokenEvent(generated_token_count=0, text="")

    @property
    def tokens(self) -> list[TokenInfo]:
        return [e.token for e in self.events if e.token is not None]
