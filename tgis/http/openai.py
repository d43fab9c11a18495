"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (JSON and SSE) on the Frontend.

Request bodies are parsed into pydantic models, mapped onto GenerationParams (vLLM's extras included),
validated with TGIS's rules and messages, and run on the shared EngineLoop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from aiohttp import web
from pydantic import ConfigDict, Field

from tgis.errors import ValidationError
from tgis.guided import ANY_JSON_OBJECT_SCHEMA, Constraint, choice_constraint, json_schema_constraint
from tgis.http.api import HttpApi
from tgis.http.errors import RequestBody
from tgis.http.frontend import Frontend
from tgis.http.sse import SseWriter
from tgis.service.context import Prompt
from tgis.service.events import Outcome
from tgis.types import (
    DecodingMethod,
    GenerationParams,
    InputTokensEvent,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    StopReason,
    TokenEvent,
    TokenInfo,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5  # OpenAI's limit for completions' `logprobs`
MAX_TOP_LOGPROBS = 10  # TGIS's top_n_tokens limit (OpenAI allows 20)
FINISH_REASONS = {
    StopReason.EOS_TOKEN: "stop",
    StopReason.STOP_SEQUENCE: "stop",
    StopReason.MAX_TOKENS: "length",
    StopReason.TOKEN_LIMIT: "length",
    StopReason.TIME_LIMIT: "length",
    StopReason.CANCELLED: "abort",
    StopReason.ERROR: "error",
}


class StreamOptions(RequestBody):
    include_usage: bool = False


class _Sampling(RequestBody):
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


class CompletionRequest(_Sampling, _Guided):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(RequestBody):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling, _Guided):
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
    request: _Sampling, *, max_tokens: int, top_n: int | None, input_details: bool, vocab_size: int
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


class OpenAIRoutes:
    def __init__(self, frontend: Frontend, run: HttpApi) -> None:
        self.frontend = frontend
        self.run = run  # HttpApi: body parsing, then permits, drain, metrics, log and tracing around a job

    @property
    def _vocab_size(self) -> int:
        return self.frontend.ctx.spec.vocab_size

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)

    # ---- /v1/models ---------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        base = self.frontend.served_model
        data = [{"id": base, "object": "model", "created": created, "owned_by": "tgis", "root": base}]
        store = self.frontend.ctx.adapters
        if store is not None:
            ids = await asyncio.to_thread(store.available_ids)
            for adapter_id in ids:
                data.append(
                    {
                        "id": adapter_id,
                        "object": "model",
                        "created": created,
                        "owned_by": "tgis",
                        "root": adapter_id,
                        "parent": base,
                    }
                )
        return web.json_response({"object": "list", "data": data})

    # ---- /v1/completions ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await self.run.parse(request, CompletionRequest)
        prompts = _prompts(body.prompt)
        if body.suffix:
            raise ValidationError("suffix is not supported")
        if body.best_of is not None and body.best_of != body.n:
            raise ValidationError("best_of must equal n (or be unset)")
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        params = generation_params(
            body,
            max_tokens=max_tokens,
            top_n=body.logprobs,
            input_details=body.echo,
            vocab_size=self._vocab_size,
        )
        model = body.model or self.frontend.served_model
        copies = [p for p in prompts for _ in range(body.n)]
        job = await self.run.prepare(
            request, "openai_completions", copies, params, body.model, constraint=guided_constraint(body)
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.stream:
            outcomes = await job.collect()
            choices = [
                self._completion_choice(i, o, body.echo, body.logprobs) for i, o in enumerate(outcomes)
            ]
            response = _response(rid, "text_completion", created, model, choices, _usage(outcomes))
            return web.json_response(response)
        stream = _ChunkStream(request, body, rid, "text_completion", created, model)
        await stream.open()
        offsets = [0] * len(copies)
        async for index, event in job.stream():
            validated = job.submitted[index].task.input
            if isinstance(event, InputTokensEvent):
                if body.echo:
                    logprobs = (
                        self._logprobs(_input_infos(event.tokens), 0) if body.logprobs is not None else None
                    )
                    offsets[index] = len(validated.text)
                    await stream.send_choice(
                        {
                            "index": index,
                            "text": validated.text,
                            "logprobs": logprobs,
                            "finish_reason": None,
                        }
                    )
                continue
            if body.echo and body.logprobs is None and event.generated_token_count <= 1:
                await stream.send_choice(
                    {"index": index, "text": validated.text, "logprobs": None, "finish_reason": None}
                )
                offsets[index] = len(validated.text)
            logprobs = None
            if body.logprobs is not None and event.token is not None:
                logprobs = self._logprobs([event.token], offsets[index])
            offsets[index] += len(event.text)
            finish = _finish_reason(event) if event.finished else None
            await stream.send_choice(
                {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": finish}
            )
        return await stream.finish(job.outcomes())

    def _completion_choice(
        self, index: int, outcome: Outcome, echo: bool, logprobs: int | None
    ) -> dict[str, Any]:
        prefix = outcome.validated.text if echo else ""
        body: dict[str, Any] = {
            "index": index,
            "text": prefix + outcome.text,
            "logprobs": None,
            "finish_reason": _finish_reason(outcome.final),
        }
        if logprobs is not None:
            infos = (_input_infos(outcome.input_tokens) if echo else []) + list(outcome.tokens)
            body["logprobs"] = self._logprobs(infos, 0)
        return body

    def _logprobs(self, infos: Sequence[TokenInfo | None], offset: int) -> dict[str, Any]:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for info in infos:
            if info is None:  # the first prompt token has no logprob
                continue
            text = self._display(info.text)
            tokens.append(text)
            logprobs.append(None if info.logprob != info.logprob else info.logprob)
            tops.append({self._display(t): lp for t, lp in info.top_tokens} or None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _display(self, token: str) -> str:
        """A vocabulary string (`Ġthe`) as the text it stands for (` the`)."""
        try:
            return str(self.frontend.ctx.tokenizer.hf.convert_tokens_to_string([token]))
        except Exception:
            return token

    # ---- /v1/chat/completions -----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatRequest = await self.run.parse(request, ChatRequest)
        prompt = await asyncio.to_thread(self._render_chat, body)
        max_tokens = body.max_completion_tokens or body.max_tokens or self.frontend.ctx.limits.max_new_tokens
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise ValidationError("top_logprobs requires logprobs to be true")
        params = generation_params(
            body, max_tokens=max_tokens, top_n=top_n, input_details=False, vocab_size=self._vocab_size
        )
        model = body.model or self.frontend.served_model
        copies: list[Prompt] = [prompt] * body.n
        job = await self.run.prepare(
            request,
            "openai_chat",
            copies,
            params,
            body.model,
            special_tokens=False,
            constraint=guided_constraint(body),
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.stream:
            outcomes = await job.collect()
            choices = []
            for i, o in enumerate(outcomes):
                choice: dict[str, Any] = {
                    "index": i,
                    "message": {"role": "assistant", "content": o.text},
                    "logprobs": {"content": [self._chat_logprob(t) for t in o.tokens]}
                    if body.logprobs
                    else None,
                    "finish_reason": _finish_reason(o.final),
                }
                choices.append(choice)
            response = _response(rid, "chat.completion", created, model, choices, _usage(outcomes))
            return web.json_response(response)
        stream = _ChunkStream(request, body, rid, "chat.completion.chunk", created, model)
        await stream.open()
        for index in range(len(copies)):
            await stream.send_choice(
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        async for index, event in job.stream():
            if isinstance(event, InputTokensEvent):
                continue
            logprobs = None
            if body.logprobs and event.token is not None:
                logprobs = {"content": [self._chat_logprob(event.token)]}
            finish = _finish_reason(event) if event.finished else None
            await stream.send_choice(
                {
                    "index": index,
                    "delta": {"content": event.text},
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            )
        return await stream.finish(job.outcomes())

    def _render_chat(self, body: ChatRequest) -> str:
        hf = self.frontend.ctx.tokenizer.hf
        if not getattr(hf, "chat_template", None):
            raise ValidationError(
                "this model has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja); "
                "use /v1/completions instead"
            )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {}),
            )
        except Exception as exc:
            raise ValidationError(f"could not apply the chat template: {exc}") from exc
        return str(text)

    def _chat_logprob(self, info: TokenInfo) -> dict[str, Any]:
        text = self._display(info.text)
        return {
            "token": text,
            "logprob": info.logprob,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": self._display(t), "logprob": lp, "bytes": list(self._display(t).encode("utf-8"))}
                for t, lp in info.top_tokens
            ],
        }


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValidationError("prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _input_infos(tokens: Sequence[TokenInfo]) -> list[TokenInfo | None]:
    """Input token details; the first token has no logprob (NaN from the engine): left out."""
    return [None if i == 0 else t for i, t in enumerate(tokens)]


def _finish_reason(event: TokenEvent) -> str | None:
    return FINISH_REASONS.get(StopReason(event.stop_reason))


def _response(
    rid: str, kind: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    """OpenAI's envelope of a response or stream chunk (`object` is `kind`)."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, "usage": usage}


class _ChunkStream:
    """One streamed OpenAI response: each chunk carries one choice under the same id, object, created
    time and model; with `stream_options.include_usage` every chunk has `usage` (null) and a last
    chunk with no choices gives the totals; then `[DONE]`."""

    def __init__(
        self, request: web.Request, body: _Sampling, rid: str, kind: str, created: int, model: str
    ) -> None:
        self._sse = SseWriter(request)
        self._envelope = (rid, kind, created, model)
        self._include_usage = body.stream_options is not None and body.stream_options.include_usage

    async def open(self) -> None:
        await self._sse.open()

    async def send_choice(self, choice: dict[str, Any]) -> None:
        await self._sse.send(self._chunk([choice], None))

    async def finish(self, outcomes: Sequence[Outcome]) -> web.StreamResponse:
        if self._include_usage:
            await self._sse.send(self._chunk([], _usage(outcomes)))
        await self._sse.done()
        return self._sse.response

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        out = _response(*self._envelope, choices, usage)
        if not self._include_usage:
            del out["usage"]
        return out


def _usage(outcomes: Sequence[Outcome]) -> dict[str, int]:
    # n copies of one prompt count its tokens once per copy, as OpenAI bills them.
    prompt = sum(len(o.validated.input_ids) for o in outcomes)
    completion = sum(o.final.generated_token_count for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
