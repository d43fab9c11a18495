"""Value objects → protobuf responses, for unary calls, stream messages, Tokenize and ModelInfo."""

from __future__ import annotations

from collections.abc import Sequence

from tgis.pb import generation_pb2 as pb
from tgis.types import TokenEvent, TokenInfo


def token_info_pb(info: TokenInfo) -> pb.TokenInfo:
    return pb.TokenInfo(
        text=info.text,
        logprob=info.logprob,
        rank=info.rank,
        top_tokens=[pb.TokenInfo.TopToken(text=text, logprob=logprob) for text, logprob in info.top_tokens],
    )


def unary_response(
    *,
    input_token_count: int,
    events: Sequence[TokenEvent],
    input_tokens: Sequence[TokenInfo],
    text_prefix: str,
    seed: int,
) -> pb.GenerationResponse:
    """Fold one input's events into its unary answer; the texts concatenate exactly as streamed."""
    final = events[-1] if events else TokenEvent(generated_token_count=0, text="")
    return pb.GenerationResponse(
        input_token_count=input_token_count,
        generated_token_count=final.generated_token_count,
        text=text_prefix + "".join(event.text for event in events),
        stop_reason=final.stop_reason.name,
        stop_sequence=final.stop_sequence or "",
        seed=seed,
        tokens=[token_info_pb(event.token) for event in events if event.token is not None],
        input_tokens=[token_info_pb(info) for info in input_tokens],
    )


def stream_first_message(
    *, input_token_count: int, input_text: str | None, seed: int
) -> pb.GenerationResponse:
    """The first stream message: input count, echoed input (never the "\\n\\n"), seed (SPEC §4.1)."""
    return pb.GenerationResponse(input_token_count=input_token_count, text=input_text or "", seed=seed)


def stream_input_tokens_message(tokens: Sequence[TokenInfo]) -> pb.GenerationResponse:
    return pb.GenerationResponse(
        input_token_count=len(tokens), input_tokens=[token_info_pb(t) for t in tokens]
    )


def stream_token_message(event: TokenEvent, *, seed: int) -> pb.GenerationResponse:
    """A progress message, or the final one (stop reason, stop sequence, seed again) (SPEC §4.3–§4.4)."""
    message = pb.GenerationResponse(
        generated_token_count=event.generated_token_count,
        text=event.text,
        stop_reason=event.stop_reason.name,
        tokens=[token_info_pb(event.token)] if event.token is not None else [],
    )
    if event.finished:
        message.stop_sequence = event.stop_sequence or ""
        message.seed = seed
    return message


def tokenize_response(
    ids: Sequence[int],
    token_strings: Sequence[str] | None,
    byte_offsets: Sequence[tuple[int, int]] | None,
    truncate: int,
) -> pb.TokenizeResponse:
    """Counts, tokens and offsets of the last `truncate` tokens (left truncation, SPEC §2.7)."""
    count = min(len(ids), truncate) if truncate > 0 else len(ids)
    start = len(ids) - count
    response = pb.TokenizeResponse(token_count=count)
    if token_strings is not None:
        response.tokens.extend(token_strings[start:])
    if byte_offsets is not None:
        response.offsets.extend(pb.TokenizeResponse.Offset(start=s, end=e) for s, e in byte_offsets[start:])
    return response
