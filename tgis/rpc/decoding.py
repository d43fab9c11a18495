"""Registers the GenerationService so that a request which does not parse is the client's error.

grpc's own registration parses each request before the servicer sees it, and a parse failure (a
string field holding bytes that are not UTF-8, such as an encoded lone surrogate) becomes the
framework's INTERNAL "Exception deserializing request!". Here the parse failure travels to the
handler as an `Undecodable` value instead, and the handler answers INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from tgis.pb import generation_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"]


@dataclass(frozen=True)
class Undecodable:
    """A request body protobuf could not parse, and why."""

    reason: str

    @property
    def message(self) -> str:
        return f"the request could not be parsed: {self.reason}"


def _tolerant(parse: Callable[[bytes], Message]) -> Callable[[bytes], Message | Undecodable]:
    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return deserialize


def _unary(behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]]):
    async def handle(request: Message | Undecodable, context: grpc.aio.ServicerContext) -> Message:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behaviour(request, context)

    return handle


def _streaming(behaviour: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Message]]):
    async def handle(
        request: Message | Undecodable, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Message]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for message in behaviour(request, context):
            yield message

    return handle


def add_generation_service(servicer: object, server: grpc.aio.Server) -> None:
    """What the generated `add_GenerationServiceServicer_to_server` does, with tolerant parsing."""
    handlers = {}
    for method in SERVICE.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        behaviour = getattr(servicer, method.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        wrap = _streaming if method.server_streaming else _unary
        handlers[method.name] = make(
            wrap(behaviour),
            request_deserializer=_tolerant(request_class.FromString),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
