"""HTTP error bodies and statuses: TgisError and bad bodies → OpenAI's or TGI's error object (4xx)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticError

from tgis.errors import ErrorCode, TgisError, ValidationError

STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNKNOWN: 500,
}
OPENAI_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
TGI_TYPES = {
    400: "validation",
    401: "authentication",
    404: "validation",
    429: "overloaded",
    503: "unavailable",
}
# Clients back off this long after a 429 (all permits in use: a slot frees when any request ends).
RETRY_AFTER_SECONDS = 1
M = TypeVar("M", bound=BaseModel)


class RequestBody(BaseModel):
    """The base of every HTTP request model. Python's JSON parser takes `NaN` and `Infinity` literals
    and reads 1e999 as inf; no parameter means anything with them, so they are a 400 naming the field."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @classmethod
    def refuse_unimplemented(cls, data: dict[str, Any]) -> None:
        """Raise ValidationError naming a field the API defines and this server does not implement
        (tgis.http.defined_fields); the bodies of APIs that define such fields override it."""


class HttpError(Exception):
    """A client-visible failure with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def status_of(exc: TgisError) -> int:
    """A request's `model` that names no served model nor loadable adapter is a 404, as in vLLM."""
    from tgis.http.frontend import ModelNotFoundError
    from tgis.service.context import AdapterLookupError

    if isinstance(exc, ModelNotFoundError | AdapterLookupError):
        return 404
    return STATUS[exc.code]


def error_body(status: int, message: str, *, openai: bool) -> dict[str, Any]:
    if openai:
        return {
            "error": {
                "message": message,
                "type": OPENAI_TYPES.get(status, "InternalServerError"),
                "param": None,
                "code": status,
            }
        }
    return {"error": message, "error_type": TGI_TYPES.get(status, "generation")}


def error_response(status: int, message: str, *, openai: bool) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 429 else None
    return web.json_response(error_body(status, message, openai=openai), status=status, headers=headers)


def parse_body(body: bytes, model: type[M]) -> M:
    """The body as `model`; a precise 400 message for bad JSON, wrong types and out-of-range values."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValidationError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ValidationError("request body is not valid JSON: it is nested too deeply") from exc
    if not isinstance(data, dict):
        raise ValidationError("request body must be a JSON object")
    if issubclass(model, RequestBody):
        model.refuse_unimplemented(data)
    try:
        return model.model_validate(data)
    except PydanticError as exc:
        raise ValidationError(describe(exc)) from exc


def describe(exc: PydanticError) -> str:
    """`field.path: problem` for each error, e.g. `max_tokens: Input should be a valid integer`."""
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)
