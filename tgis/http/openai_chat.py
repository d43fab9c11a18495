"""POST /v1/chat/completions: messages through the tokenizer's chat template (with the request's tools),
then text or tool calls, as one JSON response or SSE chunks."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tgis.errors import ValidationError
from tgis.http.api import HttpApi, Job
from tgis.http.frontend import Frontend
from tgis.http.openai_bodies import ChatRequest, generation_params, guided_constraint
from tgis.http.openai_shapes import (
    ChunkStream,
    beam_fields,
    chat_logprob,
    delta_choice,
    finish_reason,
    response,
    usage,
)
from tgis.http.openai_tools import ToolPlan, template_messages, tool_constraint, tool_plan
from tgis.http.tool_calls import ArgumentsDelta, CallStarted, ToolCallReader, read_calls, starts_a_call
from tgis.http.vllm_decoding import bad_word_ids, beam_params
from tgis.service.context import Prompt
from tgis.service.events import Outcome
from tgis.types import InputTokensEvent, TokenEvent, TokenInfo

TOOL_CALLS = "tool_calls"  # the finish reason of an answer that is calls


class ChatRoute:
    def __init__(self, frontend: Frontend, run: HttpApi) -> None:
        self.frontend = frontend
        self.run = run

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatRequest = await self.run.parse(request, ChatRequest)
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        constraint = guided_constraint(body)
        calls = tool_constraint(plan) if plan is not None else None
        if calls is not None and constraint is not None:
            raise ValidationError(
                "tool_choice other than none cannot be combined with response_format or guided_*: "
                "both constrain the answer"
            )
        prompt = await asyncio.to_thread(self._render, body, plan)
        ctx = self.frontend.ctx
        max_tokens = body.max_completion_tokens or body.max_tokens or ctx.limits.max_new_tokens
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise ValidationError("top_logprobs requires logprobs to be true")
        beam = beam_params(body)
        params = generation_params(
            body,
            max_tokens=max_tokens,
            top_n=top_n,
            input_details=False,
            vocab_size=ctx.spec.vocab_size,
            defaults=self.frontend.sampling_defaults,
            bad_words=bad_word_ids(body.bad_words, self.frontend.encode_words),
            beam=beam,
        )
        copies: list[Prompt] = [prompt] * (1 if beam is not None else body.n)
        job = await self.run.prepare(
            request,
            "openai_chat",
            copies,
            params,
            body.model,
            streamed=body.stream,
            special_tokens=False,
            constraint=calls or constraint,
            user=body.user or body.safety_identifier,
        )
        rid, created = f"chatcmpl-{job.call.request_id}", int(time.time())
        model = body.model or self.frontend.served_model
        if body.stream:
            stream = ChunkStream(request, body, rid, "chat.completion.chunk", created, model)
            return await self._stream(stream, body, job, plan)
        outcomes = await job.collect()
        if beam is not None:
            beams = outcomes[0].final.beams
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": b.text},
                    "logprobs": None,
                    **beam_fields(b),
                }
                for i, b in enumerate(beams)
            ]
        else:
            choices = [self._choice(i, o, body.logprobs, plan) for i, o in enumerate(outcomes)]
        return web.json_response(response(rid, "chat.completion", created, model, choices, usage(outcomes)))

    def _choice(self, index: int, outcome: Outcome, logprobs: bool, plan: ToolPlan | None) -> dict[str, Any]:
        text, finish = outcome.text, finish_reason(outcome.final)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        found = read_calls(text) if _may_be_calls(plan, text) else None
        if found:
            message = {"role": "assistant", "content": None, "tool_calls": [c.as_message() for c in found]}
            finish = TOOL_CALLS
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": [self._logprob(t) for t in outcome.tokens]} if logprobs else None,
            "finish_reason": finish,
        }

    async def _stream(
        self, stream: ChunkStream, body: ChatRequest, job: Job, plan: ToolPlan | None
    ) -> web.StreamResponse:
        await stream.open()
        choices = [_StreamedChoice(plan) for _ in job.submitted]
        for index in range(len(job.submitted)):
            await stream.send_choice(delta_choice(index, {"role": "assistant", "content": ""}, None, None))
        async for index, event in job.stream():
            if isinstance(event, InputTokensEvent):
                continue
            logprobs = None
            if body.logprobs and event.token is not None:
                logprobs = {"content": [self._logprob(event.token)]}
            delta = choices[index].delta(event.text)
            finish = choices[index].finish(event) if event.finished else None
            if delta or logprobs or finish or not choices[index].calls:
                await stream.send_choice(delta_choice(index, delta, logprobs, finish))
        return await stream.finish(job.outcomes())

    def _render(self, body: ChatRequest, plan: ToolPlan | None) -> str:
        """The prompt: the messages through the chat template, with the tools when there are any (a
        template that leaves them out cannot serve tool calling: a 400 says so)."""
        hf = self.frontend.ctx.tokenizer.hf
        if not getattr(hf, "chat_template", None):
            raise ValidationError(
                "this model has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja); "
                "use /v1/completions instead"
            )
        messages = template_messages([m.model_dump(exclude_none=True) for m in body.messages])
        options = {"add_generation_prompt": body.add_generation_prompt, **(body.chat_template_kwargs or {})}
        try:
            text = plain = hf.apply_chat_template(messages, tokenize=False, **options)
            if plan is not None:
                tools = plan.template_tools()
                text = hf.apply_chat_template(messages, tools=tools, tokenize=False, **options)
        except Exception as exc:
            raise ValidationError(f"could not apply the chat template: {exc}") from exc
        if plan is not None and text == plain:
            raise ValidationError(
                "this model's chat template does not render tools (the prompt is the same with and "
                "without them), so the model could not know them: tools need a template that renders "
                "transformers' `tools`"
            )
        return str(text)

    def _logprob(self, info: TokenInfo) -> dict[str, Any]:
        return chat_logprob(self.frontend.ctx.tokenizer.hf, info)


def _may_be_calls(plan: ToolPlan | None, text: str) -> bool:
    return plan is not None and plan.calls and (plan.mode != "auto" or starts_a_call(text))


@dataclass
class _StreamedChoice:
    """One streamed choice: text deltas, or once its first character says it is calls (always, unless
    `auto` let it start as text), tool-call deltas."""

    plan: ToolPlan | None
    calls: bool = False
    decided: bool = False
    reader: ToolCallReader = field(default_factory=ToolCallReader)

    def delta(self, text: str) -> dict[str, Any]:
        if not self.decided and text:
            self.decided = True
            self.calls = _may_be_calls(self.plan, text)
        if not self.calls:
            return {"content": text}
        deltas: dict[int, dict[str, Any]] = {}
        for found in self.reader.feed(text):
            if isinstance(found, CallStarted):
                call = found.call
                function = {"name": call.name, "arguments": ""}
                deltas[call.index] = {
                    "index": call.index,
                    "id": call.id,
                    "type": "function",
                    "function": function,
                }
            elif isinstance(found, ArgumentsDelta):
                entry = deltas.setdefault(found.index, {"index": found.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += found.text
        return {"tool_calls": list(deltas.values())} if deltas else {}

    def finish(self, event: TokenEvent) -> str | None:
        if self.calls and self.reader.complete:
            return TOOL_CALLS
        return finish_reason(event)
