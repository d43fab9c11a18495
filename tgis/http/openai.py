"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, as JSON or SSE.

Request bodies (`openai_bodies`) map onto GenerationParams; the service core validates them with
TGIS's rules and messages and runs them on the shared engine loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from tgis.errors import ValidationError
from tgis.http.api import HttpApi, Job
from tgis.http.frontend import Frontend
from tgis.http.openai_bodies import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    SamplingBody,
    generation_params,
    guided_constraint,
)
from tgis.http.sse import SseWriter
from tgis.service.context import Prompt
from tgis.service.events import Outcome
from tgis.types import InputTokensEvent, StopReason, TokenEvent, TokenInfo

FINISH_REASONS = {
    StopReason.EOS_TOKEN: "stop",
    StopReason.STOP_SEQUENCE: "stop",
    StopReason.MAX_TOKENS: "length",
    StopReason.TOKEN_LIMIT: "length",
    StopReason.TIME_LIMIT: "length",
    StopReason.CANCELLED: "abort",
    StopReason.ERROR: "error",
}


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
        copies = [p for p in prompts for _ in range(body.n)]
        job = await self.run.prepare(
            request,
            "openai_completions",
            copies,
            params,
            body.model,
            streamed=body.stream,
            constraint=guided_constraint(body),
        )
        envelope = (f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.model or self.frontend.served_model)
        if not body.stream:
            outcomes = await job.collect()
            choices = [
                self._completion_choice(i, o, body.echo, body.logprobs) for i, o in enumerate(outcomes)
            ]
            rid, created, model = envelope
            return web.json_response(
                _response(rid, "text_completion", created, model, choices, _usage(outcomes))
            )
        return await self._stream_completions(request, body, job, envelope)

    async def _stream_completions(
        self, request: web.Request, body: CompletionRequest, job: Job, envelope: tuple[str, int, str]
    ) -> web.StreamResponse:
        rid, created, model = envelope
        stream = _ChunkStream(request, body, rid, "text_completion", created, model)
        await stream.open()
        offsets = [0] * len(job.submitted)
        async for index, event in job.stream():
            text = job.submitted[index].task.input.text
            if isinstance(event, InputTokensEvent):
                if body.echo:
                    infos = _input_infos(event.tokens)
                    logprobs = self._logprobs(infos, 0) if body.logprobs is not None else None
                    offsets[index] = len(text)
                    await stream.send_choice(_text_choice(index, text, logprobs, None))
                continue
            if body.echo and body.logprobs is None and event.generated_token_count <= 1:
                await stream.send_choice(_text_choice(index, text, None, None))
                offsets[index] = len(text)
            logprobs = None
            if body.logprobs is not None and event.token is not None:
                logprobs = self._logprobs([event.token], offsets[index])
            offsets[index] += len(event.text)
            finish = _finish_reason(event) if event.finished else None
            await stream.send_choice(_text_choice(index, event.text, logprobs, finish))
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
        copies: list[Prompt] = [prompt] * body.n
        job = await self.run.prepare(
            request,
            "openai_chat",
            copies,
            params,
            body.model,
            streamed=body.stream,
            special_tokens=False,
            constraint=guided_constraint(body),
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        model = body.model or self.frontend.served_model
        if body.stream:
            stream = _ChunkStream(request, body, rid, "chat.completion.chunk", created, model)
            return await self._stream_chat(stream, body, job)
        outcomes = await job.collect()
        choices = [self._chat_choice(i, o, body.logprobs) for i, o in enumerate(outcomes)]
        return web.json_response(_response(rid, "chat.completion", created, model, choices, _usage(outcomes)))

    def _chat_choice(self, index: int, outcome: Outcome, logprobs: bool) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": outcome.text},
            "logprobs": {"content": [self._chat_logprob(t) for t in outcome.tokens]} if logprobs else None,
            "finish_reason": _finish_reason(outcome.final),
        }

    async def _stream_chat(self, stream: _ChunkStream, body: ChatRequest, job: Job) -> web.StreamResponse:
        await stream.open()
        for index in range(len(job.submitted)):
            await stream.send_choice(_delta_choice(index, {"role": "assistant", "content": ""}, None, None))
        async for index, event in job.stream():
            if isinstance(event, InputTokensEvent):
                continue
            logprobs = None
            if body.logprobs and event.token is not None:
                logprobs = {"content": [self._chat_logprob(event.token)]}
            finish = _finish_reason(event) if event.finished else None
            await stream.send_choice(_delta_choice(index, {"content": event.text}, logprobs, finish))
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


def _text_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _delta_choice(
    index: int, delta: dict[str, str], logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


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
        self, request: web.Request, body: SamplingBody, rid: str, kind: str, created: int, model: str
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
