"""Log setup (LOG_LEVEL, JSON_OUTPUT) and the one line logged per generation request."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

from tgis.log_filter import log_filter_or_info
from tgis.types import DecodingMethod, GenerationParams

REQUEST_LOGGER = logging.getLogger("tgis.requests")
# The request id of the call being handled (x-request-id, else x-correlation-id, else a generated one).
REQUEST_ID: ContextVar[str | None] = ContextVar("request_id", default=None)
TIMES = ("validation_time", "queue_time", "inference_time", "time_per_token", "total_time")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, target, message, and `fields` when a line has them."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="microseconds"),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        fields = getattr(record, "fields", None)
        if fields:
            entry["fields"] = fields
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class RequestIdFilter(logging.Filter):
    """Stamps each record with the id of the request whose task logged it (None outside requests)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, then ` request_id=…` on the lines a request logged."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        return line if request_id is None else f"{line} request_id={request_id}"


def log_handler(json_output: bool = False, stream: TextIO | None = None) -> logging.Handler:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if json_output else TextFormatter())
    return handler


def configure_logging(level: str = "info", json_output: bool = False, stream: TextIO | None = None) -> None:
    """Route every logger to one stderr handler, as plain text or JSON lines, filtered by `level`
    (LOG_LEVEL: a level, or EnvFilter-style directives; see tgis.log_filter)."""
    handler = log_handler(json_output, stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    log_filter, warning = log_filter_or_info(level)
    log_filter.apply()
    if warning is not None:
        logging.getLogger("tgis").warning(warning)


# Library output that does not belong in a server's log: gRPC C-core's own lines, hub/transformers
# progress bars. Defaults only: an operator's explicit value wins.
QUIET_ENV_DEFAULTS = {"GRPC_VERBOSITY": "ERROR", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
SECRET_SETTING = re.compile(r"(^|_)(key|token|secret|password|credentials?)(_|$)", re.IGNORECASE)


def quiet_libraries(environ: MutableMapping[str, str]) -> None:
    """Call before grpc is imported (its C-core reads GRPC_VERBOSITY once, at import)."""
    for name, value in QUIET_ENV_DEFAULTS.items():
        environ.setdefault(name, value)


def settings_line(version: str, settings: Mapping[str, Any]) -> str:
    """The one startup line: the version and every effective setting, secrets masked."""
    shown = {
        name: "***" if value is not None and SECRET_SETTING.search(name) else value
        for name, value in settings.items()
    }
    return f"tgis {version} starting with " + " ".join(f"{name}={value}" for name, value in shown.items())


def params_summary(params: GenerationParams) -> dict[str, Any]:
    """The parameters that shape a generation, without their defaults' noise."""
    stopping = params.stopping
    summary: dict[str, Any] = {
        "method": params.method.name,
        "max_new_tokens": stopping.max_new_tokens,
        "min_new_tokens": stopping.min_new_tokens,
    }
    if params.method == DecodingMethod.SAMPLE:
        sampling = params.sampling
        summary.update(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            typical_p=sampling.typical_p,
            seed=sampling.seed,
        )
        if sampling.min_p:
            summary["min_p"] = sampling.min_p
    if params.repetition_penalty != 1.0:
        summary["repetition_penalty"] = params.repetition_penalty
    if params.length_penalty is not None:
        summary["length_penalty"] = [params.length_penalty.start_index, params.length_penalty.decay_factor]
    if stopping.stop_sequences:
        summary["stop_sequences"] = len(stopping.stop_sequences)
    if stopping.stop_token_ids:
        summary["stop_token_ids"] = len(stopping.stop_token_ids)
    if stopping.time_limit_millis:
        summary["time_limit_millis"] = stopping.time_limit_millis
    if params.truncate_input_tokens:
        summary["truncate_input_tokens"] = params.truncate_input_tokens
    wanted = [name for name, value in vars(params.response).items() if value and name != "input_scores"]
    if wanted:
        summary["response"] = wanted
    return summary


@dataclass(frozen=True)
class InputOutcome:
    """How one input of a request ended; times in seconds, None where the input never got there."""

    input_tokens: int
    generated_tokens: int
    stop_reason: str
    queue_time: float | None = None
    inference_time: float | None = None


@dataclass
class RequestRecord:
    """Collects one request's facts as it goes, then logs them: one line per input (TGIS's unit)."""

    method: str
    correlation_id: str | None
    arrival: float = field(default_factory=time.monotonic)
    input_chars: Sequence[int] = ()
    params: GenerationParams | None = None
    validation_time: float | None = None
    request_id: str | None = None
    user: str | None = None  # OpenAI's `user` (or `safety_identifier`): the caller's own end user

    def finish(self, outcomes: Sequence[InputOutcome]) -> None:
        total = time.monotonic() - self.arrival
        for index, outcome in enumerate(outcomes):
            fields = self._fields(index, len(outcomes))
            fields.update(_timings(self.validation_time, outcome, total))
            fields.update(
                input_tokens=outcome.input_tokens,
                generated_tokens=outcome.generated_tokens,
                stop_reason=outcome.stop_reason,
            )
            message = (
                f"{self.method} generated {outcome.generated_tokens} tokens before {outcome.stop_reason}: "
                + _render(fields)
            )
            REQUEST_LOGGER.info(message, extra={"fields": fields})

    def fail(self, error: str) -> None:
        fields = self._fields(None, len(self.input_chars))
        fields["total_time"] = time.monotonic() - self.arrival
        if self.validation_time is not None:
            fields["validation_time"] = self.validation_time
        fields["error"] = error
        REQUEST_LOGGER.info(f"{self.method} failed: {_render(fields)}", extra={"fields": fields})

    def _fields(self, index: int | None, count: int) -> dict[str, Any]:
        fields: dict[str, Any] = {"method": self.method, "correlation_id": self.correlation_id}
        if self.request_id is not None and self.request_id != self.correlation_id:
            fields["request_id"] = self.request_id
        if self.user is not None:
            fields["user"] = self.user
        if index is not None and count > 1:
            fields["input"] = f"{index + 1}/{count}"
        if index is not None and index < len(self.input_chars):
            fields["input_chars"] = self.input_chars[index]
        elif self.input_chars:
            fields["input_chars"] = list(self.input_chars)
        if self.params is not None:
            fields["params"] = params_summary(self.params)
        return fields


def _timings(validation: float | None, outcome: InputOutcome, total: float) -> dict[str, float]:
    times = {
        "validation_time": validation,
        "queue_time": outcome.queue_time,
        "inference_time": outcome.inference_time,
        "time_per_token": (
            outcome.inference_time / outcome.generated_tokens
            if outcome.inference_time is not None and outcome.generated_tokens
            else None
        ),
        "total_time": total,
    }
    return {name: value for name, value in times.items() if value is not None}


def _render(fields: dict[str, Any]) -> str:
    parts = []
    for name, value in fields.items():
        if name in TIMES:
            parts.append(f"{name}={value * 1000:.3f}ms")
        elif isinstance(value, dict):
            parts.append(f"{name}={{{_render(value)}}}")
        elif isinstance(value, list):
            parts.append(f"{name}=[{','.join(str(v) for v in value)}]")
        else:
            parts.append(f"{name}={value}")
    return " ".join(parts)
