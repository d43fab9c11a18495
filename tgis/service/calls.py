"""One call's request log line and trace span, opened by a front door and filled in as the call goes.

A call has a request id: the client's `x-request-id` (HTTP header or gRPC metadata), else its
`x-correlation-id` (TGIS's), else a new one. It names the call in every log line and in the trace, and
goes back to the client beside the correlation id, which stays the client's own or, absent, the request id.
"""

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
REQUEST_ID_KEY = "x-request-id"  # likewise (vLLM's and most proxies' request id)
MAX_ID_CHARS = 256


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
        Every line the calling task logs from now on carries the request id."""
        given = {k.lower(): str(v) for k, v in metadata if k.lower() in (CORRELATION_ID, REQUEST_ID_KEY)}
        correlation_id = _usable(given.get(CORRELATION_ID))
        request_id = _usable(given.get(REQUEST_ID_KEY)) or correlation_id or uuid.uuid4().hex
        correlation_id = correlation_id or request_id
        REQUEST_ID.set(request_id)
        span = tracing.request(span_name or method, metadata)
        span.set_attributes(request_id=request_id, correlation_id=correlation_id, inputs=len(prompts))
        record = RequestRecord(
            method, correlation_id, arrival, input_chars=[len(p) for p in prompts], request_id=request_id
        )
        return cls(record, span)

    @property
    def request_id(self) -> str:
        assert self.record.request_id is not None
        return self.record.request_id

    def echoed(self) -> tuple[tuple[str, str], ...]:
        """The ids that go back to the client (HTTP response headers, gRPC metadata)."""
        return ((REQUEST_ID_KEY, self.request_id), (CORRELATION_ID, self.correlation_id))

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


def _usable(value: str | None) -> str | None:
    """A client's id, if it can be echoed as it came: printable ASCII, at most MAX_ID_CHARS."""
    if not value or len(value) > MAX_ID_CHARS or not (value.isascii() and value.isprintable()):
        return None
    return value


def _between(start: float | None, end: float | None) -> float | None:
    return end - start if start is not None and end is not None else None
