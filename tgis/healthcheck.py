"""`grpc_healthcheck`: exit 0 when the server's grpc.health.v1 answers SERVING, 1 otherwise. For exec
probes, with vllm-tgis-adapter's flags (`--server-url`, `--service-name`, `--insecure`/`--secure`,
`--timeout`), plus the files a TLS or mutual-TLS server needs (`--ca-cert`, `--client-cert`,
`--client-key`). Health needs no API key."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="grpc_healthcheck", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    security = parser.add_mutually_exclusive_group()
    security.add_argument("--insecure", dest="secure", action="store_false", help="Plaintext")
    security.add_argument("--secure", dest="secure", action="store_true", help="TLS")
    parser.set_defaults(secure=False)
    parser.add_argument("--server-url", default="localhost:8033", help="host:port of the gRPC server")
    parser.add_argument("--service-name", default="", help="Service to check ('' is the whole server)")
    parser.add_argument("--timeout", type=float, default=1.0, help="Seconds to wait for the answer")
    parser.add_argument("--ca-cert", type=Path, help="--secure: PEM of the CA that signed the server")
    parser.add_argument("--client-cert", type=Path, help="--secure: PEM client certificate (mutual TLS)")
    parser.add_argument("--client-key", type=Path, help="--secure: PEM client key (mutual TLS)")
    return parser.parse_args(argv)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.secure:
        return grpc.insecure_channel(args.server_url)

    def read(path: Path | None) -> bytes | None:
        return None if path is None else path.read_bytes()

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.ca_cert),
        private_key=read(args.client_key),
        certificate_chain=read(args.client_cert),
    )
    return grpc.secure_channel(args.server_url, credentials)


def check(args: argparse.Namespace) -> bool:
    """Whether the server reports SERVING; prints what it answered (or why there was no answer)."""
    request = health_pb2.HealthCheckRequest(service=args.service_name)
    try:
        with _channel(args) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"Health.Check failed: code={exc.code()}, details={exc.details()}")  # type: ignore[attr-defined]
        return False
    except OSError as exc:
        print(f"Health.Check failed: {exc}")
        return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"status: {status}")
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(0 if check(_parse(sys.argv[1:] if argv is None else argv)) else 1)
