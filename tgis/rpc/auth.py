"""API_KEY on gRPC: every fmaas.GenerationService call carries `authorization: Bearer <key>` metadata, or
is refused with UNAUTHENTICATED (logged with the peer's address and counted, as HTTP's refusals are).
grpc.health.v1 and reflection stay open: exec probes and tools carry no key."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tgis.service.access import AccessGuard, Door, Refusal

AUTHORIZATION = "authorization"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, guard: AccessGuard, guarded_service: str) -> None:
        self.guard = guard
        self.prefix = f"/{guarded_service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or not method.startswith(self.prefix):
            return handler
        metadata = dict(details.invocation_metadata or ())  # type: ignore[attr-defined]
        refusal = self.guard.check_api_key(_text(metadata.get(AUTHORIZATION)))
        if refusal is None:
            return handler
        return _refusing(handler, self.guard, refusal, method)


def _text(value: str | bytes | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _refusing(
    handler: grpc.RpcMethodHandler, guard: AccessGuard, refusal: Refusal, method: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape that refuses the call before its request is looked at."""

    async def refuse(context: grpc.aio.ServicerContext) -> None:
        guard.refused(Door.GRPC, refusal, peer=context.peer(), target=method)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal.message)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    async def streamed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(context)
        yield  # never reached: makes this an async generator, as a streaming handler is

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streamed, **serializers)
    return grpc.unary_unary_rpc_method_handler(unary, **serializers)
