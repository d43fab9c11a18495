"""TGI's REST API: POST /generate, /generate_stream (SSE), / (by `stream`), GET /info, POST /tokenize.

Shapes follow Hugging Face text-generation-inference (what its `text-generation` client parses):
`details` with `prefill`/`tokens`/`top_tokens`, `best_of` with `best_of_sequences`. Parameters map
onto GenerationParams and are validated with TGIS's rules and messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from tgis import __version__
from tgis.errors import ValidationError
from tgis.http.api import HttpApi, Job
from tgis.http.frontend import Frontend
from tgis.http.sse import SseWriter
from tgis.http.tgi_bodies import (
    MAX_BEST_OF,
    GenerateRequest,
    Parameters,
    TokenizeRequest,
    generation_params,
    grammar_constraint,
)
from tgis.http.vllm_decoding import bad_word_ids
from tgis.service.events import Outcome
from tgis.types import (
    InputTokensEvent,
    StopReason,
    TokenEvent,
    TokenInfo,
)

FINISH_REASONS = {
    StopReason.EOS_TOKEN: "eos_token",
    StopReason.STOP_SEQUENCE: "stop_sequence",
    StopReason.MAX_TOKENS: "length",
    StopReason.TOKEN_LIMIT: "length",
    StopReason.TIME_LIMIT: "length",
    StopReason.CANCELLED: "length",
    StopReason.ERROR: "length",
}


class TgiRoutes:
    def __init__(self, frontend: Frontend, api: HttpApi, watermark: tuple[float, float]) -> None:
        self.frontend = frontend
        self.api = api
        self.watermark = watermark  # WATERMARK_GAMMA, WATERMARK_DELTA

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/", self.root)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/generate_stream", self.generate_stream)
        app.router.add_get("/info", self.info)
        app.router.add_post("/tokenize", self.tokenize)

    async def root(self, request: web.Request) -> web.StreamResponse:
        body = await self.api.parse(request, GenerateRequest)
        if body.stream:
            return await self._stream(request, body)
        return await self._generate(request, body, as_list=True)  # TGI's compat route answers a list

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, await self.api.parse(request, GenerateRequest))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, await self.api.parse(request, GenerateRequest))

    # ---- generation ---------------------------------------------------------------------------------

    async def _job(
        self, request: web.Request, kind: str, body: GenerateRequest, copies: int, *, streamed: bool
    ) -> Job:
        words = bad_word_ids(body.parameters.bad_words, self.frontend.encode_words)
        params = generation_params(body.parameters, self.watermark, words)
        return await self.api.prepare(
            request,
            kind,
            [body.inputs] * copies,
            params,
            body.parameters.adapter_id,
            streamed=streamed,
            constraint=grammar_constraint(body.parameters.grammar),
        )

    async def _generate(
        self, request: web.Request, body: GenerateRequest, as_list: bool = False
    ) -> web.Response:
        p = body.parameters
        best_of = p.best_of or 1
        job = await self._job(request, "tgi_generate", body, best_of, streamed=False)
        outcomes = await job.collect()
        # best_of: the candidate with the highest cumulative logprob wins (TGI's rule).
        order = sorted(range(len(outcomes)), key=lambda i: -sum(t.logprob for t in outcomes[i].tokens))
        best, others = outcomes[order[0]], [outcomes[i] for i in order[1:]]
        prefix = body.inputs if p.return_full_text else ""
        answer: dict[str, Any] = {"generated_text": prefix + best.text}
        if p.details:
            details = self._details(best, p)
            if best_of > 1:
                details["best_of_sequences"] = [
                    {"generated_text": prefix + o.text, **self._details(o, p)} for o in others
                ]
            answer["details"] = details
        headers = {
            "x-generated-tokens": str(best.final.generated_token_count),
            "x-prompt-tokens": str(len(best.validated.input_ids)),
        }
        return web.json_response([answer] if as_list else answer, headers=headers)

    def _details(self, outcome: Outcome, p: Parameters) -> dict[str, Any]:
        details: dict[str, Any] = {
            "finish_reason": FINISH_REASONS.get(StopReason(outcome.final.stop_reason), "length"),
            "generated_tokens": outcome.final.generated_token_count,
            "seed": outcome.validated.seed if not outcome.validated.params.is_greedy else None,
            "prefill": self._prefill(outcome.input_tokens) if p.decoder_input_details else [],
            "tokens": [self._token(t) for t in outcome.tokens],
        }
        if p.top_n_tokens:
            details["top_tokens"] = [self._top(t) for t in outcome.tokens]
        return details

    async def _stream(self, request: web.Request, body: GenerateRequest) -> web.StreamResponse:
        p = body.parameters
        if (p.best_of or 1) > 1:
            raise ValidationError("`best_of` != 1 is not supported when `stream` == True")
        job = await self._job(request, "tgi_generate_stream", body, 1, streamed=True)
        stream = SseWriter(request)
        await stream.open()
        text = body.inputs if p.return_full_text else ""
        async for _, event in job.stream():
            if isinstance(event, InputTokensEvent):
                continue
            text += event.text
            await stream.send(self._stream_event(event, text, job, p))
        await stream.done(marker=False)
        return stream.response

    def _stream_event(self, event: TokenEvent, text: str, job: Job, p: Parameters) -> dict[str, Any]:
        info = event.token or TokenInfo(text="")
        out: dict[str, Any] = {
            "index": event.generated_token_count,
            "token": self._token(info, event.text),
            "top_tokens": self._top(info) if p.top_n_tokens else None,
            "generated_text": None,
            "details": None,
        }
        if event.finished:
            validated = job.submitted[0].task.input
            out["generated_text"] = text
            out["details"] = {
                "finish_reason": FINISH_REASONS.get(StopReason(event.stop_reason), "length"),
                "generated_tokens": event.generated_token_count,
                "seed": validated.seed if not validated.params.is_greedy else None,
                "input_length": len(validated.input_ids),
            }
        return out

    # ---- token shapes -------------------------------------------------------------------------------

    def _id(self, token: str) -> int:
        token_id = self.frontend.ctx.tokenizer.hf.convert_tokens_to_ids(token)
        assert isinstance(token_id, int)
        return token_id

    def _text(self, token: str) -> str:
        try:
            return str(self.frontend.ctx.tokenizer.hf.convert_tokens_to_string([token]))
        except Exception:
            return token

    def _token(self, info: TokenInfo, text: str | None = None) -> dict[str, Any]:
        token_id = self._id(info.text)
        return {
            "id": token_id,
            "text": self._text(info.text) if text is None else text,
            "logprob": info.logprob,
            "special": token_id in self.frontend.ctx.tokenizer.special_ids,
        }

    def _top(self, info: TokenInfo) -> list[dict[str, Any]]:
        special = self.frontend.ctx.tokenizer.special_ids
        return [
            {"id": self._id(t), "text": self._text(t), "logprob": lp, "special": self._id(t) in special}
            for t, lp in info.top_tokens
        ]

    def _prefill(self, tokens: Sequence[TokenInfo]) -> list[dict[str, Any]]:
        return [
            {"id": self._id(t.text), "text": self._text(t.text), "logprob": None if i == 0 else t.logprob}
            for i, t in enumerate(tokens)
        ]

    # ---- /info, /tokenize ---------------------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        ctx = self.frontend.ctx
        spec = ctx.spec
        limits = ctx.limits
        return web.json_response(
            {
                "model_id": self.frontend.served_model,
                "model_sha": None,
                "model_dtype": str(spec.dtype).removeprefix("torch."),
                "model_device_type": spec.device.type,
                "model_pipeline_tag": "text2text-generation"
                if spec.is_encoder_decoder
                else "text-generation",
                "max_concurrent_requests": ctx.permits.capacity,
                "max_best_of": MAX_BEST_OF,
                "max_stop_sequences": 6,
                "max_input_tokens": limits.max_sequence_length - 1,
                "max_input_length": limits.max_sequence_length - 1,
                "max_total_tokens": limits.max_sequence_length,
                "max_new_tokens": limits.max_new_tokens,
                "version": __version__,
                "sha": None,
                "docker_label": None,
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self.api.parse(request, TokenizeRequest)
        tokenizer = self.frontend.ctx.tokenizer
        encoding = await asyncio.to_thread(
            tokenizer.hf,
            body.inputs,
            add_special_tokens=self.frontend.ctx.add_special_tokens,
            return_offsets_mapping=True,
        )
        ids = list(encoding["input_ids"])
        if body.parameters.truncate:
            ids = list(tokenizer.truncate(ids, body.parameters.truncate))
        offsets = list(encoding["offset_mapping"])[-len(ids) :] if ids else []
        strings = tokenizer.token_strings(ids)
        return web.json_response(
            [
                {"id": i, "text": body.inputs[start:stop] or self._text(s), "start": start, "stop": stop}
                for i, s, (start, stop) in zip(ids, strings, offsets, strict=True)
            ]
        )
