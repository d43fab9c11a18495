"""Entry points: `text-generation-launcher` (serve) and `text-generation-server` (subcommands)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError as SettingsError

from tgis import __version__
from tgis.config import Settings, StartupError, shard_count
from tgis.logs import configure_logging, quiet_libraries, settings_line
from tgis.model_choice import wants_demo_model
from tgis.openmp import default_spin_count, run_torch_work
from tgis.unimplemented import warn_unimplemented

if TYPE_CHECKING:
    from tgis.app import TgisServer

logger = logging.getLogger("tgis")

TERMINATION_LOG = "/dev/termination-log"
# Where the termination message goes instead: vllm-tgis-adapter's TERMINATION_LOG_DIR (a file path, or a
# directory to write `termination-log` in), else Kubernetes' TERMINATION_MESSAGE_PATH.
TERMINATION_LOG_ENVS = ("TERMINATION_LOG_DIR", "TERMINATION_MESSAGE_PATH")
# TGIS's launcher default for shards it starts, where the operator set nothing: fewer fragmentation
# OOMs. An empty value means "unset it".
DEFAULT_PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True"
# Errors an operator causes and can fix: reported as one line, never with a traceback.
OPERATOR_ERRORS = (StartupError, FileNotFoundError, ValueError, OSError)
FATAL_LOOP_EXIT_CODE = 2
# TGIS launcher spellings beyond `--foo-bar`: its short flags and its tracing flag's name.
TGIS_FLAG_ALIASES = {
    "port": ("-p",),
    "grpc_port": ("-g",),
    "cuda_process_memory_fraction": ("-c",),
    "otel_service_name": ("--otlp-service-name",),
}


def _flag_parser(prog: str) -> argparse.ArgumentParser:
    """One `--foo-bar` flag per setting; a flag wins over the FOO_BAR env var."""
    parser = argparse.ArgumentParser(prog=prog, description="TGIS-compatible text generation server")
    _add_version(parser)
    for name, field in Settings.model_fields.items():
        flags = ["--" + name.replace("_", "-"), *TGIS_FLAG_ALIASES.get(name, ())]
        if field.annotation is bool:
            parser.add_argument(
                *flags, dest=name, nargs="?", const="true", default=None, help=field.description
            )
        else:
            help_text = f"{field.description} (env {name.upper()})"
            parser.add_argument(*flags, dest=name, default=None, help=help_text)
    return parser


def _add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def load_settings(argv: Sequence[str], prog: str) -> Settings:
    args = _flag_parser(prog).parse_args(argv)
    overrides = {name: value for name, value in vars(args).items() if value is not None}
    return Settings(**overrides)


def fail_startup(message: str, *, json_output: bool = False) -> int:
    """Operator errors end with one clear line (also in the termination log), no traceback."""
    if json_output:
        logger.critical(message)
    else:
        print(f"ERROR: {message}", file=sys.stderr, flush=True)
    write_termination_log(message)
    return 1


def termination_log_path(environ: Mapping[str, str]) -> str:
    for name in TERMINATION_LOG_ENVS:
        path = environ.get(name)
        if path:
            return os.path.join(path, "termination-log") if os.path.isdir(path) else path
    return TERMINATION_LOG


def write_termination_log(message: str) -> None:
    """Best effort: the file exists only in a pod, and is not writable outside one."""
    try:
        with open(termination_log_path(os.environ), "w") as log:
            log.write(message + "\n")
    except OSError:
        pass


def cuda_process_defaults(settings: Settings, environ: MutableMapping[str, str]) -> None:
    """TGIS's launcher defaults for the processes that run CUDA (this one and its shards), set before
    torch loads: PYTORCH_CUDA_ALLOC_CONF, and TF32 for cuBLAS matmuls unless ALLOW_TF32=false. Logged at
    debug: the settings line shows the settings, and on a CPU neither does anything."""
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is None:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_PYTORCH_CUDA_ALLOC_CONF
        logger.debug(f"Setting PYTORCH_CUDA_ALLOC_CONF to default value: {DEFAULT_PYTORCH_CUDA_ALLOC_CONF}")
    elif not conf.strip():
        del environ["PYTORCH_CUDA_ALLOC_CONF"]
        logger.debug("PYTORCH_CUDA_ALLOC_CONF is unset")
    else:
        logger.debug(f"PYTORCH_CUDA_ALLOC_CONF is set to: {conf}")
    if settings.allow_tf32:
        environ.setdefault("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")


TRUE_WORDS = {"1", "true", "t", "yes", "y", "on"}  # what pydantic reads as true


def json_output_asked(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """JSON_OUTPUT (or --json-output) as given, for the lines written when the settings fail to load."""
    for i, arg in enumerate(argv):
        if arg == "--json-output":
            following = argv[i + 1] if i + 1 < len(argv) else ""
            return following.lower() in TRUE_WORDS or following.startswith("-") or not following
        if arg.startswith("--json-output="):
            return arg.split("=", 1)[1].lower() in TRUE_WORDS
    return environ.get("JSON_OUTPUT", "").strip().lower() in TRUE_WORDS


def _settings_error_line(error: SettingsError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    message = first["msg"].removeprefix("Value error, ")
    return f"invalid setting {where.upper()}: {message}" if where else message


async def _start(settings: Settings, stop: asyncio.Event) -> TgisServer:
    """Resolve config, load the model, bind the ports (SPEC §9.4 order). Once the model is loaded
    (which cannot be interrupted: until then SIGTERM just ends the process), SIGTERM and SIGINT set
    `stop`, before any port opens, so a signal that arrives as the server comes up still drains it."""
    wants_demo_model(settings, os.environ)  # MODEL_NAME required and unset: fail before torch loads
    from tgis.app import TgisServer, load_model
    from tgis.tls import load_tls

    settings.warn_legacy()
    warn_unimplemented(os.environ)
    tls = load_tls(settings)  # before the model: a bad TLS file should not cost a model load first
    shards = shard_count(settings, os.environ)  # the model loader reads it too, for the engine

    def load() -> TgisServer:  # the KV pool and PT2 warm-up too: torch work stays off the event loop's thread
        return TgisServer(settings, load_model(settings, os.environ), tls=tls, shards=shards)

    server = await run_torch_work(load, name="model-load")
    freeze_startup_objects()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    return server


def unfreeze_for_exit() -> None:
    """Let the interpreter's teardown collect the frozen objects too (xgrammar's bindings report
    every object of theirs still alive at exit as a leak)."""
    gc.unfreeze()


def freeze_startup_objects() -> None:
    """Leave what startup built (the model, libraries, the server) out of every later garbage collection.

    A full collection walks every tracked object while holding the GIL, so each one stalled the engine
    step and the event loop together, for longer as the heap grew (27-244 ms on the benchmark model).
    Frozen objects are never collected, which suits objects that live as long as the process."""
    gc.collect()
    gc.freeze()


async def _serve(settings: Settings) -> int:
    stop = asyncio.Event()
    try:
        server = await _start(settings, stop)
    except OPERATOR_ERRORS as exc:
        return fail_startup(str(exc), json_output=settings.json_output)
    except Exception as exc:
        logger.exception("Startup failed")
        write_termination_log(f"Startup failed: {exc}")
        return 1
    while not stop.is_set() and server.fatal is None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    if server.fatal is not None:
        message = f"The batching loop crashed: {server.fatal}"
        logger.error(f"{message}; exiting")
        write_termination_log(message)
        await server.stop(grace=0)
        return FATAL_LOOP_EXIT_CODE
    logger.info("Shutting down: no longer admitting requests")
    await server.stop()
    logger.info("Shutdown complete")
    return 0


def run_server(argv: Sequence[str], prog: str) -> int:
    quiet_libraries(os.environ)
    default_spin_count(os.environ)  # before torch loads libgomp
    try:
        settings = load_settings(argv, prog)
    except SettingsError as exc:
        json_output = json_output_asked(argv, os.environ)  # the settings did not load: read it raw
        configure_logging(json_output=json_output)
        return fail_startup(_settings_error_line(exc), json_output=json_output)
    configure_logging(settings.log_level, settings.json_output)
    cuda_process_defaults(settings, os.environ)
    from tgis.preflight import preflight

    try:
        preflight(settings, os.environ)  # before torch is imported: cheap mistakes fail at once
    except OPERATOR_ERRORS as exc:
        return fail_startup(str(exc), json_output=settings.json_output)
    logger.info(settings_line(__version__, settings.model_dump()))
    try:
        return asyncio.run(_serve(settings))
    finally:
        unfreeze_for_exit()


def launcher_main() -> None:
    sys.exit(run_server(sys.argv[1:], "text-generation-launcher"))


# `benchmark` is the separate tgis-bench tool (bench/ in the repository): run with the same arguments.
BENCHMARK_HELP = "Run the tgis-bench tool with these arguments (benchmark, soak, compare: tgis-bench --help)"
BENCHMARK_MISSING = (
    "ERROR: the benchmark is the separate tgis-bench tool, not installed here: from a checkout, "
    "`pip install -e ./bench`, then `tgis-bench --help`"
)


def run_benchmark_tool(rest: list[str]) -> int:
    """Replaces this process with `tgis-bench REST...` where the tool is installed; else 1, one line."""
    if importlib.util.find_spec("tgis_bench") is None:
        print(BENCHMARK_MISSING, file=sys.stderr)
        return 1
    os.execv(sys.executable, [sys.executable, "-m", "tgis_bench", *rest])


def server_main() -> None:
    parser = argparse.ArgumentParser(prog="text-generation-server")
    _add_version(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "serve", help="Serve a model (same flags as text-generation-launcher)", add_help=False
    )
    commands.add_parser("build-demo-model", help="Build (once) the built-in demo model and print its path")
    commands.add_parser("benchmark", help=BENCHMARK_HELP, add_help=False)
    from tgis.model_files.commands import WEIGHTS_COMMANDS, add_weights_commands, run_weights_command

    add_weights_commands(commands)
    args, rest = parser.parse_known_args()
    if args.command in WEIGHTS_COMMANDS:
        sys.exit(run_weights_command(args, rest, os.environ))
    if args.command == "serve":
        sys.exit(run_server(rest, "text-generation-server serve"))
    if args.command == "benchmark":
        sys.exit(run_benchmark_tool(rest))
    if args.command == "build-demo-model":
        from tgis.demo_model import ensure_demo_model

        configure_logging()
        print(ensure_demo_model())
