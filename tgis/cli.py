"""Entry points: `text-generation-launcher` (serve) and `text-generation-server` (subcommands)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from pydantic import ValidationError as SettingsError

from tgis.config import Settings

logger = logging.getLogger("tgis")

TERMINATION_LOG = "/dev/termination-log"
DEFAULT_SHUTDOWN_GRACE_SECONDS = 30.0


def _flag_parser(prog: str) -> argparse.ArgumentParser:
    """One `--foo-bar` flag per setting; a flag wins over the FOO_BAR env var."""
    parser = argparse.ArgumentParser(prog=prog, description="TGIS-compatible text generation server")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, nargs="?", const="true", default=None, help=field.description)
        else:
            parser.add_argument(flag, default=None, help=f"{field.description} (env {name.upper()})")
    return parser


def load_settings(argv: Sequence[str], prog: str) -> Settings:
    args = _flag_parser(prog).parse_args(argv)
    overrides = {name: value for name, value in vars(args).items() if value is not None}
    return Settings(**overrides)


def _configure_logging(settings: Settings | None) -> None:
    level = (settings.log_level if settings else os.environ.get("LOG_LEVEL", "info")).upper()
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def fail_startup(message: str) -> int:
    """Operator errors end with one clear line (also in the termination log), no traceback."""
    print(f"ERROR: {message}", file=sys.stderr)
    try:
        with open(TERMINATION_LOG, "w") as log:
            log.write(message + "\n")
    except OSError:
        pass
    return 1


def _settings_error_line(error: SettingsError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    return (
        f"invalid setting {where.upper()}: {first['msg']}"
        if where
        else first["msg"].removeprefix("Value error, ")
    )


async def _serve(settings: Settings) -> int:
    from tgis.server.app import TgisServer, load_model

    settings.warn_legacy()
    model = await asyncio.to_thread(load_model, settings, os.environ)
    server = TgisServer(settings, model)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set() and server.fatal is None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    logger.info("Shutting down")
    await server.stop(DEFAULT_SHUTDOWN_GRACE_SECONDS)
    if server.fatal is not None:
        logger.error(f"Exiting after a fatal engine error: {server.fatal}")
        return 2
    return 0


def run_server(argv: Sequence[str], prog: str) -> int:
    try:
        settings = load_settings(argv, prog)
    except SettingsError as exc:
        _configure_logging(None)
        return fail_startup(_settings_error_line(exc))
    _configure_logging(settings)
    try:
        return asyncio.run(_serve(settings))
    except (FileNotFoundError, ValueError, OSError) as exc:
        return fail_startup(str(exc))


def launcher_main() -> None:
    sys.exit(run_server(sys.argv[1:], "text-generation-launcher"))


def server_main() -> None:
    parser = argparse.ArgumentParser(prog="text-generation-server")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "serve", help="Serve a model (same flags as text-generation-launcher)", add_help=False
    )
    commands.add_parser("build-demo-model", help="Build (once) the built-in demo model and print its path")
    args, rest = parser.parse_known_args()
    if args.command == "serve":
        sys.exit(run_server(rest, "text-generation-server serve"))
    if args.command == "build-demo-model":
        from tgis.demo_model import ensure_demo_model

        logging.basicConfig(level=logging.INFO)
        print(ensure_demo_model())
