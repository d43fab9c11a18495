"""The soak's gRPC calls: Generate (one input or several) and GenerateStream (read through, or cancelled)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Answer:
    """How one request ended as the client saw it: its outcome code and the tokens it got."""

    code: str  # "grpc:OK", "grpc:CANCELLED", "http:200", "http:closed", "http:500:in-stream", ...
    tokens: int
    ttft: float | None = None  # streams only: seconds from sending to the first token


def greedy(
    new_tokens: int,
    *,
    exact: bool = True,
    decoding: pb.DecodingParameters | None = None,
    time_limit_ms: int = 0,
) -> pb.Parameters:
    """Greedy parameters; `exact` also sets min_new_tokens, so an early EOS does not end the request
    (guided requests end with their constraint instead)."""
    stopping = pb.StoppingCriteria(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens if exact else 0, time_limit_millis=time_limit_ms
    )
    return pb.Parameters(method=pb.GREEDY, stopping=stopping, decoding=decoding)


async def generate(
    stub: pb_grpc.GenerationServiceStub,
    texts: Sequence[str],
    params: pb.Parameters,
    *,
    timeout: float,
    adapter_id: str | None = None,
) -> Answer:
    """One Generate call with every text as an input; the tokens of all its answers."""
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text) for text in texts], params=params, adapter_id=adapter_id
    )
    reply = await stub.Generate(request, timeout=timeout)
    return Answer("grpc:OK", sum(answer.generated_token_count for answer in reply.responses))


async def generate_stream(
    stub: pb_grpc.GenerationServiceStub,
    text: str,
    params: pb.Parameters,
    *,
    timeout: float,
    adapter_id: str | None = None,
    cancel_after: int | None = None,
) -> Answer:
    """A GenerateStream call read to its end, or cancelled by the client once `cancel_after` tokens came."""
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=text), params=params, adapter_id=adapter_id
    )
    started = time.perf_counter()
    call = stub.GenerateStream(request, timeout=timeout)
    generated, first = 0, None
    async for answer in call:
        if answer.generated_token_count > generated:
            first = time.perf_counter() - started if first is None else first
            generated = answer.generated_token_count
        if cancel_after is not None and generated >= cancel_after:
            # False when the call had already ended: then its own status stands.
            if call.cancel():
                return Answer("grpc:CANCELLED", generated, first)
            return Answer(f"grpc:{(await call.code()).name}", generated, first)
    return Answer("grpc:OK", generated, first)
