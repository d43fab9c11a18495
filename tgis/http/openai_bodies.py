"""OpenAI's request bodies (vLLM's extras included) and their mapping onto GenerationParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from tgis.errors import ValidationError
from tgis.guided import ANY_JSON_OBJECT_SCHEMA, Constraint, choice_constraint, json_schema_constraint
from tgis.http.errors import RequestBody
from tgis.types import (
    DecodingMethod,
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5  # OpenAI's limit for completions' `logprobs`
MAX_TOP_LOGPROBS = 10  # TGIS's top_n_tokens limit (OpenAI allows 20)


class StreamOptions(RequestBody):
    include_usage: bool = False


class SamplingBody(RequestBody):
    """The parameters completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = None
    ignore_eos: bool = False


class JsonSchemaFormat(RequestBody):
    model_config = ConfigDict(extra="allow")

    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Guided(RequestBody):
    """Structured output: OpenAI's `response_format`, or one of vLLM's `guided_*` extras."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_constraint(request: _Guided) -> Constraint | None:
    """The request's constraint on the same mechanism as gRPC's `decoding.guided` (None: free text)."""
    given = [name for name in GUIDED_FIELDS if getattr(request, name) is not None]
    if len(given) > 1:
        raise ValidationError(f"only one of {', '.join(GUIDED_FIELDS)} may be set, got {', '.join(given)}")
    fmt = request.response_format
    if fmt is not None:
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint("format", ANY_JSON_OBJECT_SCHEMA)
        if fmt.json_schema is None:
            raise ValidationError("response_format of type json_schema needs a json_schema object")
        return json_schema_constraint(fmt.json_schema.schema_)
    if request.guided_json is not None:
        return json_schema_constraint(request.guided_json)
    if request.guided_regex is not None:
        return Constraint("regex", request.guided_regex)
    if request.guided_choice is not None:
        return choice_constraint(request.guided_choice)
    if request.guided_grammar is not None:
        return Constraint("grammar", request.guided_grammar)
    return None


class CompletionRequest(SamplingBody, _Guided):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(RequestBody):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingBody, _Guided):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


def logit_bias_pairs(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token-id strings → bias in [-100, 100]) as sorted (id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise ValidationError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        token = int(key)
        if token >= vocab_size:
            raise ValidationError(f"logit_bias token id {token} must be in [0, {vocab_size})")
        if not -100.0 <= value <= 100.0:
            raise ValidationError(f"logit_bias value for token {token} must be in [-100, 100], got {value}")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def generation_params(
    request: SamplingBody, *, max_tokens: int, top_n: int | None, input_details: bool, vocab_size: int
) -> GenerationParams:
    """OpenAI/vLLM fields → GenerationParams. Temperature 0 is greedy; unset is OpenAI's 1.0."""
    temperature = 1.0 if request.temperature is None else request.temperature
    greedy = temperature == 0.0
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    sampling = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=request.seed,
    )
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or ())
    # vLLM's ignore_eos: EOS is never chosen, so generation runs to max_tokens.
    min_new = max_tokens if request.ignore_eos else request.min_tokens
    wants_logprobs = top_n is not None
    return GenerationParams(
        method=DecodingMethod.GREEDY if greedy else DecodingMethod.SAMPLE,
        sampling=SamplingParams() if greedy else sampling,
        stopping=StoppingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=min_new,
            stop_sequences=tuple(stops),
            include_stop_sequence=False,  # OpenAI leaves the stop string out
        ),
        response=ResponseOptions(
            generated_tokens=wants_logprobs,
            input_tokens=wants_logprobs and input_details,
            token_logprobs=wants_logprobs,
            top_n_tokens=top_n or 0,
        ),
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=logit_bias_pairs(request.logit_bias, vocab_size),
    )
