"""OpenAI's response shapes both routes share: the envelope, finish reasons, usage, token text and
logprobs, and the streamed chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from tgis.http.openai_bodies import SamplingBody
from tgis.http.sse import SseWriter
from tgis.service.events import Outcome
from tgis.types import Beam, StopReason, TokenEvent, TokenInfo

FINISH_REASONS = {
    StopReason.EOS_TOKEN: "stop",
    StopReason.STOP_SEQUENCE: "stop",
    StopReason.MAX_TOKENS: "length",
    StopReason.TOKEN_LIMIT: "length",
    StopReason.TIME_LIMIT: "length",
    StopReason.CANCELLED: "abort",
    StopReason.ERROR: "error",
}


def finish_reason(event: TokenEvent) -> str | None:
    return FINISH_REASONS.get(StopReason(event.stop_reason))


def response(
    rid: str, kind: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, int] | None
) -> dict[str, Any]:
    """OpenAI's envelope of a response or stream chunk (`object` is `kind`)."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, "usage": usage}


def beam_fields(beam: Beam) -> dict[str, Any]:
    """A beam choice's finish reason, and vLLM-style scores: the sum of its tokens' log-probabilities
    and the score beams are ranked by (that sum over generated length ** length_penalty)."""
    return {
        "finish_reason": FINISH_REASONS.get(beam.stop_reason),
        "cumulative_logprob": beam.cumulative_logprob,
        "beam_score": beam.score,
    }


def usage(outcomes: Sequence[Outcome]) -> dict[str, int]:
    # n copies of one prompt count its tokens once per copy, as OpenAI bills them; n beams each count.
    prompt = sum(len(o.validated.input_ids) for o in outcomes)
    completion = sum(
        sum(b.generated_token_count for b in o.final.beams) or o.final.generated_token_count for o in outcomes
    )
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def delta_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def display(tokenizer: PreTrainedTokenizerBase, token: str) -> str:
    """A vocabulary string (`Ġthe`) as the text it stands for (` the`)."""
    try:
        return str(tokenizer.convert_tokens_to_string([token]))
    except Exception:
        return token


def chat_logprob(tokenizer: PreTrainedTokenizerBase, info: TokenInfo) -> dict[str, Any]:
    """One token of chat's `logprobs.content`, with its top alternatives."""
    text = display(tokenizer, info.text)
    tops = [(display(tokenizer, t), lp) for t, lp in info.top_tokens]
    return {
        "token": text,
        "logprob": info.logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in tops],
    }


class ChunkStream:
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
            await self._sse.send(self._chunk([], usage(outcomes)))
        await self._sse.done()
        return self._sse.response

    def _chunk(self, choices: list[dict[str, Any]], totals: dict[str, int] | None) -> dict[str, Any]:
        out = response(*self._envelope, choices, totals)
        if not self._include_usage:
            del out["usage"]
        return out
