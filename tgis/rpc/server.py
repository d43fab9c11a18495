"""The gRPC server on GRPC_PORT: the GenerationService, grpc.health.v1 and reflection, plain or TLS."""

from __future__ import annotations

import errno
import logging
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tgis.errors import StartupError
from tgis.pb import generation_pb2 as pb
from tgis.rpc.auth import ApiKeyInterceptor
from tgis.rpc.decoding import add_generation_service
from tgis.rpc.servicer import GenerationServicer
from tgis.service.access import AccessGuard
from tgis.service.context import ServiceContext
from tgis.tls import TlsFiles

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_SERVICES = ("", SERVICE_NAME)
# Without this, Linux lets a second server bind the same gRPC port and silently share its traffic.
GRPC_OPTIONS = (("grpc.so_reuseport", 0),)


class GrpcServer:
    def __init__(self, tls: TlsFiles | None, guard: AccessGuard) -> None:
        self.tls = tls
        self.guard = guard
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self, context: ServiceContext, port: int, *, serving: bool) -> int:
        """Bind `port` (0 picks a free one), serve, and report `serving` on grpc.health.v1."""
        guarded = self.guard.api_key is not None
        interceptors = [ApiKeyInterceptor(self.guard, SERVICE_NAME)] if guarded else []
        server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        self.server = server
        add_generation_service(GenerationServicer(context), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
        address = f"[::]:{port}"
        try:
            if self.tls is None:
                self.port = server.add_insecure_port(address)
            else:
                self.port = server.add_secure_port(address, self.tls.server_credentials())
        except RuntimeError as exc:  # grpc says only "Failed to bind": find out why for the operator
            raise StartupError(_bind_failure(port)) from exc
        await server.start()
        await self.set_serving(serving)
        security = "plaintext" if self.tls is None else "mutual TLS" if self.tls.mutual else "TLS"
        if guarded:
            security += ", API key"
        logger.info(f"gRPC server listening on port {self.port} ({security})")
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in HEALTH_SERVICES:
            await self.health.set(name, status)

    async def enter_graceful_shutdown(self) -> None:
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        if self.server is not None:
            await self.server.stop(grace)


def _bind_failure(port: int) -> str:
    """Why the gRPC port could not be bound, found by trying it with a plain socket."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"gRPC port {port} is already in use"
            if exc.errno != errno.EAFNOSUPPORT:
                return f"could not listen on gRPC port {port}: {exc.strerror}"
    return f"could not listen on gRPC port {port}"
