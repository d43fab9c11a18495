"""One call's request log line and trace span, opened by a front door and filled in as the call goes."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Protocol

from tgis.engine_loop.tasks import GenerationTask
from tgis.logs import REQUEST_ID, InputOutcome, RequestRecord
from tgis.tracing import RequestSpan, Tracing
from tgis.types import StopReason

CORRELATION_ID = "x-correlation-id"  # gRPC metadata key and HTTP header


class Finished(Protocol):
    """What a call's end reports of each input: a protobuf response or the final TokenEvent."""

    @property
    def generated_token_count(self) -> int: ...

    @property
    def stop_reason(self) -> int: ...


@dataclass
class RequestCall:
    record: RequestRecord
    span: RequestSpan

    @classmethod
    def open(
        cls,
        tracing: Tracing,
        metadata: Sequence[tuple[str, str]],
        prompts: Sequence[Sized],
        arrival: float,
        *,
        method: str,
        span_name: str | None = None,
    ) -> RequestCall:
        """`method` names the call in the request log, `span_name` (default `method`) its trace span.
        The correlation id is the client's `x-correlation-id`, else a new one; every line the calling
        task logs from now on carries it."""
        correlation_id = next((str(v) for k, v in metadata if k.lower() == CORRELATION_ID), None)
        correlation_id = correlation_id or uuid.uuid4().hex
        REQUEST_ID.set(correlation_id)
        span = tracing.request(span_name or method, metadata)
        span.set_attributes(correlation_id=correlation_id, inputs=len(prompts))
        record = RequestRecord(method, correlation_id, arrival, input_chars=[len(p) for p in prompts])
        return cls(record, span)

    @property
    def correlation_id(self) -> str:
        assert self.record.correlation_id is not None
        return self.record.correlation_id

    @contextlib.contextmanager
    def validating(self) -> Iterator[None]:
        started = time.monotonic()
        with self.span.validation():
            yield
        self.record.validation_time = time.monotonic() - started

    def finish(self, tasks: Sequence[GenerationTask], finals: Sequence[Finished]) -> None:
        outcomes = []
        for task, final in zip(tasks, finals, strict=True):
            self.span.phases(task.queued_at, task.admitted_at, task.finished_at)
            outcomes.append(
                InputOutcome(
                    input_tokens=len(task.input.input_ids),
                    generated_tokens=final.generated_token_count,
                    stop_reason=StopReason(final.stop_reason).name,
                    queue_time=_between(task.queued_at, task.admitted_at),
                    inference_time=_between(task.admitted_at, task.finished_at),
                )
            )
        self.span.set_attributes(
            input_tokens=sum(o.input_tokens for o in outcomes),
            generated_tokens=sum(o.generated_tokens for o in outcomes),
            stop_reason=",".join(o.stop_reason for o in outcomes),
        )
        self.span.end()
        self.record.finish(outcomes)

    def fail(self, error: str) -> None:
        self.span.end(error)
        self.record.fail(error)


def _between(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None
