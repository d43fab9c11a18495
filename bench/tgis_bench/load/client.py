"""The load generator: a closed loop of concurrent greedy gRPC requests, timed per token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis_bench.load.workload import BenchRequest


@dataclass(frozen=True)
class RequestTiming:
    """What one request cost as the client saw it (seconds since the call started)."""

    index: int
    input_tokens: int  # as the server counted them
    asked_tokens: int
    generated_tokens: int
    stop_reason: str
    latency: float
    ttft: float | None  # streaming only: a unary answer arrives all at once
    inter_token: tuple[float, ...]  # streaming only: gaps between successive tokens


@dataclass(frozen=True)
class LoadRun:
    """One pass over the workload at a fixed concurrency."""

    concurrency: int
    stream: bool
    seconds: float  # first call sent to last answer received
    requests: tuple[RequestTiming, ...]


def greedy_params(request: BenchRequest) -> pb.Parameters:
    """Greedy, with min = max new tokens: random weights may pick EOS early, which must not end it."""
    stopping = pb.StoppingCriteria(
        max_new_tokens=request.max_new_tokens, min_new_tokens=request.max_new_tokens
    )
    return pb.Parameters(method=pb.GREEDY, stopping=stopping)


async def run_load(
    target: str,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int,
    stream: bool,
    progress: bool = True,
) -> LoadRun:
    """Send every request, keeping `concurrency` in flight (each worker sends its next when one ends)."""
    mode = "stream" if stream else "unary"
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        call = _streamed if stream else _unary
        return await closed_loop(
            requests,
            concurrency,
            lambda request: call(stub, request),
            f"server c={concurrency} {mode}",
            stream=stream,
            progress=progress,
        )


async def closed_loop(
    requests: Sequence[BenchRequest],
    concurrency: int,
    send: Callable[[BenchRequest], Awaitable[RequestTiming]],
    label: str,
    *,
    stream: bool,
    progress: bool,
) -> LoadRun:
    """`concurrency` workers share one queue of requests, each sending its next when its previous one
    ends (the tgis client and the vLLM peer alike)."""
    pending: Iterator[BenchRequest] = iter(requests)  # shared: each request is taken by exactly one worker
    results: list[RequestTiming] = []
    bar = tqdm(total=len(requests), desc=label, unit="req", disable=not progress)

    async def worker() -> None:
        for request in pending:
            results.append(await send(request))
            bar.update()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    seconds = time.perf_counter() - started
    bar.close()
    return LoadRun(concurrency, stream, seconds, tuple(sorted(results, key=lambda r: r.index)))


async def _unary(stub: pb_grpc.GenerationServiceStub, request: BenchRequest) -> RequestTiming:
    message = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=request.text)], params=greedy_params(request)
    )
    started = time.perf_counter()
    reply = await stub.Generate(message)
    latency = time.perf_counter() - started
    (answer,) = reply.responses
    return RequestTiming(
        index=request.index,
        input_tokens=answer.input_token_count,
        asked_tokens=request.max_new_tokens,
        generated_tokens=answer.generated_token_count,
        stop_reason=pb.StopReason.Name(answer.stop_reason),
        latency=latency,
        ttft=None,
        inter_token=(),
    )


async def _streamed(stub: pb_grpc.GenerationServiceStub, request: BenchRequest) -> RequestTiming:
    message = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=request.text), params=greedy_params(request)
    )
    input_tokens, generated, stop_reason = 0, 0, "NOT_FINISHED"
    first: float | None = None
    gaps: list[float] = []
    started = last = time.perf_counter()
    async for answer in stub.GenerateStream(message):
        now = time.perf_counter()
        input_tokens = input_tokens or answer.input_token_count
        new = answer.generated_token_count - generated
        if new > 0:
            # A message carrying k tokens (text held back) spreads its gap over them.
            if first is None:
                first = now - started
                gaps.extend([0.0] * (new - 1))
            else:
                gaps.extend([(now - last) / new] * new)
            generated, last = answer.generated_token_count, now
        if answer.stop_reason != pb.NOT_FINISHED:
            stop_reason = pb.StopReason.Name(answer.stop_reason)
    return RequestTiming(
        index=request.index,
        input_tokens=input_tokens,
        asked_tokens=request.max_new_tokens,
        generated_tokens=generated,
        stop_reason=stop_reason,
        latency=time.perf_counter() - started,
        ttft=first,
        inter_token=tuple(gaps),
    )
