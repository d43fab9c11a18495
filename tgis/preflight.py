"""Cheap startup checks, run before torch is imported and the model loads: a mistake in a setting
costs a fraction of a second and one clear line, not a model load."""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Mapping

from tgis.config import Settings, StartupError
from tgis.http.layout import GenerationPlace, http_layout
from tgis.hub import resolve_model_path
from tgis.model_choice import DEMO_MODEL_NAME
from tgis.model_files.cache_dir import hub_cache_dir
from tgis.quantization import quantization_at_load
from tgis.tls import load_tls

# The DTYPE names torch accepts for serving (what engines.common.resolve_dtype looks up).
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "half", "float", "double")
# The engines in engines.registry.ENGINES (a test keeps the two in step; the registry imports torch).
ENGINE_NAMES = ("hf_transformers", "hf_custom_tp", "hf_optimum_ort")


def preflight(settings: Settings, environ: Mapping[str, str]) -> None:
    """StartupError (or ModelNotFoundError) for the first cheap setting that cannot work."""
    check_dtype(settings.dtype_name)
    check_engine(settings.deployment_framework)
    check_ports(settings.port, settings.grpc_port)
    check_generation_port(settings)
    check_speculator_candidates(settings.speculator_n_candidates)
    model_config = None
    if settings.model_name and settings.model_name != DEMO_MODEL_NAME:
        path = resolve_model_path(
            settings.model_name, revision=settings.revision, cache_dir=hub_cache_dir(environ)
        )
        model_config = json.loads((path / "config.json").read_text())
    quantization_at_load(  # a bad QUANTIZE, or one the checkpoint contradicts, stops here
        settings.quantize,
        dtype_name=settings.dtype_name,
        framework=settings.deployment_framework,
        model_config=model_config,
        pt2_compile=settings.pt2_compile,
    )


def check_dtype(name: str | None) -> None:
    """A torch dtype name, or TGIS's `int8` (QUANTIZE=bitsandbytes: 8-bit weights quantized at load)."""
    if name is None or name in DTYPE_NAMES or name == "int8":
        return
    raise StartupError(f"Unrecognized data type: {name} (DTYPE is one of {', '.join(DTYPE_NAMES)}, or int8)")


def check_speculator_candidates(candidates: int | None) -> None:
    if candidates not in (None, 1):
        raise StartupError(
            f"SPECULATOR_N_CANDIDATES={candidates}: this server verifies one candidate chain per sequence "
            "and step; set it to 1 or leave it unset"
        )


def check_engine(framework: str) -> None:
    if framework not in ENGINE_NAMES:
        raise StartupError(
            f"DEPLOYMENT_FRAMEWORK {framework} is not available in this build "
            f"(available: {', '.join(sorted(ENGINE_NAMES))})"
        )


def check_ports(http_port: int, grpc_port: int) -> None:
    if http_port and http_port == grpc_port:
        raise StartupError(f"PORT and GRPC_PORT are both {http_port}: the HTTP and gRPC ports must differ")
    for what, port in (("HTTP", http_port), ("gRPC", grpc_port)):  # PORT, GRPC_PORT
        if port:
            problem = port_problem(port)
            if problem:
                raise StartupError(f"{what} port {port} {problem}")


def check_generation_port(settings: Settings) -> None:
    """The TLS files load, HTTP generation has a place as protected as gRPC, and its own port (if it
    has one) is free and not another server's."""
    layout = http_layout(settings, load_tls(settings))
    port = layout.generation_port
    if layout.generation != GenerationPlace.OWN_PORT or not port:
        return
    if port == settings.grpc_port:
        raise StartupError(
            f"HTTP_GENERATION_PORT and GRPC_PORT are both {port}: the HTTP and gRPC ports must differ"
        )
    problem = port_problem(port)
    if problem:
        raise StartupError(f"HTTP generation port {port} {problem}")


def port_problem(port: int) -> str | None:
    """Why listening on `port` (all interfaces, as the servers do) would fail, else None."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
                probe.bind((host, port))
            return None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is already in use"
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                return f"cannot be listened on: {exc.strerror}"
    return None
