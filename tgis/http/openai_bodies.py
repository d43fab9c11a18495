"""OpenAI's request bodies (vLLM's extras included) and their mapping onto GenerationParams."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from tgis.errors import Msg, ValidationError
from tgis.guided import ANY_JSON_OBJECT_SCHEMA, Constraint, choice_constraint, json_schema_constraint
from tgis.http.defined_fields import OPENAI_CHAT_REFUSED, OPENAI_COMPLETIONS_REFUSED, refuse_unimplemented
from tgis.http.errors import RequestBody
from tgis.http.openai_tools import ToolChoice, ToolDefinition
from tgis.types import (
    BeamParams,
    DecodingMethod,
    GenerationParams,
    ResponseOptions,
    SamplingDefaults,
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

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}

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
    user: str | None = None  # recorded in the request's log line
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False

    @classmethod
    def refuse_unimplemented(cls, data: dict[str, Any]) -> None:
        refuse_unimplemented(data, cls.REFUSED)


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
    REFUSED = OPENAI_COMPLETIONS_REFUSED

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None


class ChatMessage(RequestBody):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingBody, _Guided):
    REFUSED = OPENAI_CHAT_REFUSED

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None  # recorded in the request's log line, as `user`


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
    request: SamplingBody,
    *,
    max_tokens: int,
    top_n: int | None,
    input_details: bool,
    vocab_size: int,
    defaults: SamplingDefaults | None = None,
    bad_words: tuple[tuple[int, ...], ...] = (),
    beam: BeamParams | None = None,
) -> GenerationParams:
    """OpenAI/vLLM fields → GenerationParams. Temperature 0 is greedy. What the request leaves unset
    takes the model's generation_config.json value (`defaults`), else OpenAI's (temperature and top_p
    1.0, no top_k, min_p or repetition penalty), as vLLM does. Beam search ranks the model's own
    log-probabilities: the sampling defaults do not apply to it."""
    d = SamplingDefaults() if beam is not None else defaults or SamplingDefaults()
    temperature = _first(request.temperature, d.temperature, 1.0)
    greedy = temperature == 0.0 or beam is not None
    top_k = int(_first(request.top_k, d.top_k, 0))
    sampling = SamplingParams(
        temperature=temperature,
        top_k=top_k if top_k > 0 else 0,  # vLLM's -1 (and 0) mean no top-k
        top_p=_first(request.top_p, d.top_p, 1.0),
        min_p=_first(request.min_p, d.min_p, 0.0),
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
            # OpenAI leaves the stop string out; vLLM's include_stop_str_in_output keeps it
            include_stop_sequence=request.include_stop_str_in_output,
            stop_token_ids=stop_token_ids(request.stop_token_ids, vocab_size),
        ),
        response=ResponseOptions(
            generated_tokens=wants_logprobs,
            input_tokens=wants_logprobs and input_details,
            token_logprobs=wants_logprobs,
            top_n_tokens=top_n or 0,
        ),
        repetition_penalty=_first(request.repetition_penalty, d.repetition_penalty, 1.0),
        truncate_input_tokens=request.truncate_prompt_tokens or 0,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=logit_bias_pairs(request.logit_bias, vocab_size),
        bad_words=bad_words,
        beam=beam,
    )


def stop_token_ids(ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    """vLLM's stop_token_ids, each a token of the vocabulary, in the order given, once each."""
    for token in ids or ():
        if not 0 <= token < vocab_size:
            raise ValidationError(Msg.STOP_TOKEN_IDS.format(vocab=vocab_size, token_id=token))
    return tuple(dict.fromkeys(ids or ()))


def _first(given: float | None, default: float | None, fallback: float) -> float:
    return given if given is not None else default if default is not None else fallback
