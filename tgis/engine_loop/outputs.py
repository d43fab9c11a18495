"""The output processor: each admitted request's stop tracking and token details, turned into events.

Step results arrive keyed by request id; this module detokenizes each request's new tokens, applies
the stop rules (SPEC §5), converts scores to client token details (SPEC §2.5), and queues the events.
A failure that belongs to one request (its detokenizer, its token details) fails that request alone.
Events are queued during a step and emitted at its end, after the finished requests' memory is free.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from engines.base import EngineSpec
from tgis.engine_loop.beam_search import FinishedBeam
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.results import InputDetails, RowFailure, SampledToken, StepResult
from tgis.engine_loop.tasks import EventSink, GenerationTask
from tgis.errors import Msg
from tgis.stopping import OutputTracker, StopCriteria
from tgis.tokenization.detokenizer import for_tokenizer
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import (
    Beam,
    FailureEvent,
    GenerationEvent,
    InputTokensEvent,
    StopReason,
    TokenDetail,
    TokenEvent,
    TokenInfo,
)

logger = logging.getLogger(__name__)


def eos_token_ids(spec: EngineSpec, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end a request with EOS_TOKEN: the model config's, else the tokenizer's (SPEC §5.5)."""
    if spec.eos_token_ids:
        return spec.eos_token_ids
    eos = tokenizer.hf.eos_token_id
    return () if eos is None else (int(eos),)


@dataclass(eq=False)
class _Active:
    task: GenerationTask
    tracker: OutputTracker
    # A task that is not streamed: its events so far, handed over with its final one.
    held: list[GenerationEvent] = field(default_factory=list)


@dataclass
class StepOutputs:
    """What `update` decided: the requests that are done (finished or failed), in the order seen."""

    finished: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, spec: EngineSpec, metrics: LoopMetrics) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids(spec, tokenizer)
        self._active: dict[int, _Active] = {}
        self._pending: list[tuple[EventSink, GenerationEvent]] = []

    # ---- membership ---------------------------------------------------------------------------------

    def start(self, task: GenerationTask) -> None:
        """Begin tracking an admitted request (raises, changing nothing, if its tracker cannot be built)."""
        self._active[task.id] = _Active(task, self._tracker(task))

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._active

    def __len__(self) -> int:
        return len(self._active)

    def tasks(self) -> list[GenerationTask]:
        return [active.task for active in self._active.values()]

    def generated(self, task_id: int) -> int:
        return self._active[task_id].tracker.generated_tokens

    def cancelled(self) -> list[int]:
        """Stop tracking the requests whose client left; returns their ids."""
        gone = [task_id for task_id, active in self._active.items() if active.task.cancelled]
        for task_id in gone:
            del self._active[task_id]
            self.metrics.failed("cancelled")
        return gone

    # ---- a step's results ---------------------------------------------------------------------------

    def update(self, result: StepResult) -> StepOutputs:
        """Queue the events of a step's results; returns the requests that are done."""
        outputs = StepOutputs()
        for task_id, failure in result.failed.items():
            if self.fail(task_id, failure):
                outputs.finished.append(task_id)
        for task_id, details in result.input_details.items():
            self._input_tokens(task_id, details)
        for task_id, tokens in result.tokens.items():
            if self._tokens(task_id, tokens, task_id in result.guide_finished):
                outputs.finished.append(task_id)
        for task_id, beams in result.beams.items():
            if self._beams(task_id, beams):
                outputs.finished.append(task_id)
        return outputs

    def fail(self, task_id: int, failure: RowFailure) -> bool:
        """Fail one request with a generation failure; False if it was no longer tracked."""
        active = self._active.pop(task_id, None)
        if active is None:
            return False
        generated = active.tracker.generated_tokens
        own = failure.detail
        if failure.per_request and generated:
            own = Msg.ERROR_AFTER_TOKENS.format(count=generated, error=failure.detail)
        self._failure(active.task, Msg.GENERATION_FAILED.format(detail=own))
        return True

    def fail_all(self, failure: RowFailure) -> list[int]:
        """Fail every tracked request (a forward that failed the whole batch); returns their ids."""
        ids = list(self._active)
        for task_id in ids:
            self.fail(task_id, failure)
        return ids

    def reject(self, task: GenerationTask, detail: str) -> None:
        """Fail a task that could not be admitted (tracked or not yet)."""
        self._active.pop(task.id, None)
        self._failure(task, Msg.GENERATION_FAILED.format(detail=detail))

    def abandon(self, tasks: Iterable[GenerationTask], detail: str) -> None:
        """After a crash: fail these tasks and every tracked one, with the same detail."""
        everyone = {task.id: task for task in tasks}
        everyone.update((task_id, active.task) for task_id, active in self._active.items())
        for task in everyone.values():
            self.reject(task, detail)

    def emit(self) -> None:
        """Send the events queued since the last emit, each request's in order."""
        pending, self._pending = self._pending, []
        for sink, event in pending:
            sink(event)

    # ---- per request --------------------------------------------------------------------------------

    def _tokens(self, task_id: int, tokens: Sequence[SampledToken], guide_finished: bool) -> bool:
        """Feed a request its new tokens; True once it is done (finished or failed)."""
        active = self._active.get(task_id)
        if active is None:
            return False  # failed earlier in this step
        self.metrics.tokens(active.task, len(tokens))
        for i, token in enumerate(tokens):
            try:
                outcome = active.tracker.on_token(token.token_id)
                if guide_finished and i == len(tokens) - 1 and not outcome.finished:
                    outcome = _guide_finished(active.tracker, outcome)
            except Exception as exc:  # this request alone fails (SPEC §3.2); the batch goes on
                self._detokenization_failed(task_id, exc)
                return True
            try:
                info = self._token_info(active.task, token)
            except Exception as exc:
                logger.exception(f"Token details of request {task_id} failed")
                return self.fail(task_id, RowFailure(f"token details: {exc}"))
            self._token_event(active, outcome, info)
            if outcome.finished:
                del self._active[task_id]
                return True
        return False

    def _beams(self, task_id: int, found: Sequence[FinishedBeam]) -> bool:
        """A beam-search request's one event: every finished beam, best first; True once handled."""
        active = self._active.pop(task_id, None)
        if active is None:
            return False
        try:
            beams = tuple(self._beam(beam) for beam in found)
        except Exception as exc:  # this request alone fails
            logger.exception(f"Beams of request {task_id} could not be decoded")
            self._failure(
                active.task, Msg.DETOKENIZATION_FAILED.format(detail=Msg.TOKEN_DECODING.format(error=exc))
            )
            return True
        best = beams[0]
        self.metrics.tokens(active.task, sum(beam.generated_token_count for beam in beams))
        self.metrics.finished(active.task, best.generated_token_count)
        event = TokenEvent(best.generated_token_count, best.text, stop_reason=best.stop_reason, beams=beams)
        self._deliver(active, event, final=True)
        return True

    def _beam(self, beam: FinishedBeam) -> Beam:
        """A finished beam for the client: its text leaves out the id that ended it, as a stop token's."""
        shown = beam.token_ids[:-1] if beam.ended else beam.token_ids
        return Beam(
            text=self.tokenizer.decode(shown),
            generated_token_count=len(beam.token_ids),
            stop_reason=StopReason.EOS_TOKEN if beam.ended else StopReason.MAX_TOKENS,
            cumulative_logprob=beam.cumulative_logprob,
            score=beam.score,
        )

    def _token_event(self, active: _Active, event: TokenEvent, info: TokenInfo | None) -> None:
        """The tracker's event for a token, with the token's details when asked for."""
        if not event.finished and not event.text and info is None:
            return  # SPEC §4.3: empty progress messages are suppressed
        if event.finished:
            self.metrics.finished(active.task, event.generated_token_count)  # first: the final event reads it
        self._deliver(active, event if info is None else replace(event, token=info), final=event.finished)

    def _deliver(self, active: _Active, event: GenerationEvent, *, final: bool) -> None:
        """Queue an event for the next emit, or hold it until the final one if the task is not streamed."""
        sink = active.task.sink
        if active.task.streamed:
            self._pending.append((sink, event))
        elif not final:
            active.held.append(event)
        else:
            self._pending.extend((sink, held) for held in active.held)
            self._pending.append((sink, event))
            active.held.clear()

    def _input_tokens(self, task_id: int, details: InputDetails) -> None:
        active = self._active.get(task_id)
        if active is None:
            return
        try:
            infos = self._input_token_infos(active.task, details)
        except Exception as exc:
            logger.exception(f"Input token details of request {task_id} failed")
            self.fail(task_id, RowFailure(f"input token details: {exc}"))
            return
        self._deliver(active, InputTokensEvent(infos), final=False)

    def _detokenization_failed(self, task_id: int, exc: Exception) -> None:
        logger.exception("Detokenization failed")
        active = self._active.pop(task_id)
        detail = Msg.TOKEN_DECODING.format(error=exc)
        self._failure(active.task, Msg.DETOKENIZATION_FAILED.format(detail=detail))

    def _failure(self, task: GenerationTask, message: str) -> None:
        self.metrics.failed("generate")
        self._pending.append((task.sink, FailureEvent(message)))

    def _tracker(self, task: GenerationTask) -> OutputTracker:
        criteria = StopCriteria.from_params(
            task.input.params.stopping,
            eos_token_ids=frozenset(self.eos_token_ids),
            arrival_time=task.arrival,
            max_new_tokens=task.input.max_new_tokens,
        )
        detokenizer = for_tokenizer(
            self.tokenizer.hf,
            task.input.input_ids,
            decoder_only=not self.spec.is_encoder_decoder,
            skip_special_tokens=self.tokenizer.skip_special_tokens,
        )
        return OutputTracker(criteria, detokenizer)

    # ---- token details ------------------------------------------------------------------------------

    def _token_info(self, task: GenerationTask, token: SampledToken) -> TokenInfo | None:
        if not task.input.params.response.generated_tokens:
            return None
        return self._to_token_info(token.token_id, token.detail)

    def _to_token_info(self, token_id: int, detail: TokenDetail | None) -> TokenInfo:
        if detail is None:
            return TokenInfo(text=self.tokenizer.token_strings([token_id])[0])
        ids = [token_id, *(top.token_id for top in detail.top_tokens)]
        texts = self.tokenizer.token_strings(ids)
        top = tuple((text, t.logprob) for text, t in zip(texts[1:], detail.top_tokens, strict=True))
        return TokenInfo(text=texts[0], logprob=detail.logprob, rank=detail.rank, top_tokens=top)

    def _input_token_infos(self, task: GenerationTask, details: InputDetails) -> tuple[TokenInfo, ...]:
        if details.details is None:  # encoder-decoder: text only, NaN logprob when asked (SPEC §2.5)
            logprob = math.nan if task.input.params.response.token_logprobs else 0.0
            texts = self.tokenizer.token_strings(list(details.token_ids))
            return tuple(TokenInfo(text=text, logprob=logprob) for text in texts)
        pairs = zip(details.token_ids, details.details, strict=True)
        return tuple(self._to_token_info(token_id, detail) for token_id, detail in pairs)


def _guide_finished(tracker: OutputTracker, outcome: TokenEvent) -> TokenEvent:
    """Guided-decoding hook: the row's grammar is complete, so it ends now with EOS_TOKEN.

    Only reached when the tracker did not stop on the grammar's final (EOS) token itself, i.e.
    while min_new_tokens was still unmet; the text this token released is kept.
    """
    final = tracker.finish_now(StopReason.EOS_TOKEN)
    return replace(final, text=outcome.text + final.text)
