"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, as JSON or SSE.

Request bodies (`openai_bodies`) map onto GenerationParams; the service core validates them with
TGIS's rules and messages and runs them on the shared engine loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from tgis.errors import ValidationError
from tgis.http.api import HttpApi, Job
from tgis.http.frontend import Frontend
from tgis.http.openai_bodies import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CompletionRequest,
    generation_params,
    guided_constraint,
)
from tgis.http.openai_chat import ChatRoute
from tgis.http.openai_shapes import ChunkStream, beam_fields, display, finish_reason, response, usage
from tgis.http.vllm_decoding import bad_word_ids, beam_params
from tgis.service.context import Prompt
from tgis.service.events import Outcome
from tgis.types import InputTokensEvent, TokenInfo


class OpenAIRoutes:
    def __init__(self, frontend: Frontend, run: HttpApi) -> None:
        self.frontend = frontend
        self.run = run  # HttpApi: body parsing, then permits, drain, metrics, log and tracing around a job
        self.chat = ChatRoute(frontend, run).chat

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
        if body.best_of is not None and body.best_of != body.n:
            raise ValidationError("best_of must equal n (or be unset)")
        max_tokens = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        beam = beam_params(body)
        params = generation_params(
            body,
            max_tokens=max_tokens,
            top_n=body.logprobs,
            input_details=body.echo,
            vocab_size=self._vocab_size,
            defaults=self.frontend.sampling_defaults,
            bad_words=bad_word_ids(body.bad_words, self.frontend.encode_words),
            beam=beam,
        )
        # n copies of each prompt; a beam search is one request returning its n beams
        copies = prompts if beam is not None else [p for p in prompts for _ in range(body.n)]
        job = await self.run.prepare(
            request,
            "openai_completions",
            copies,
            params,
            body.model,
            streamed=body.stream,
            constraint=guided_constraint(body),
            user=body.user,
        )
        envelope = (f"cmpl-{job.call.request_id}", int(time.time()), body.model or self.frontend.served_model)
        if not body.stream:
            outcomes = await job.collect()
            if beam is not None:
                choices = [
                    {"index": i, "text": b.text, "logprobs": None, **beam_fields(b)}
                    for i, b in enumerate(b for o in outcomes for b in o.final.beams)
                ]
            else:
                choices = [
                    self._completion_choice(i, o, body.echo, body.logprobs) for i, o in enumerate(outcomes)
                ]
            rid, created, model = envelope
            return web.json_response(
                response(rid, "text_completion", created, model, choices, usage(outcomes))
            )
        return await self._stream_completions(request, body, job, envelope)

    async def _stream_completions(
        self, request: web.Request, body: CompletionRequest, job: Job, envelope: tuple[str, int, str]
    ) -> web.StreamResponse:
        rid, created, model = envelope
        stream = ChunkStream(request, body, rid, "text_completion", created, model)
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
            finish = finish_reason(event) if event.finished else None
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
            "finish_reason": finish_reason(outcome.final),
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
        return display(self.frontend.ctx.tokenizer.hf, token)


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
