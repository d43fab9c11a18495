"""The installed `text-generation-launcher` as a subprocess, for tests that run the server as operators do."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.integration.harness import wait_until

LAUNCHER = shutil.which("text-generation-launcher", path=str(Path(sys.executable).parent))


class Launched:
    """A `text-generation-launcher` subprocess whose merged output is collected line by line."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        assert LAUNCHER is not None, "text-generation-launcher is not installed beside this Python"
        self.process = subprocess.Popen(
            [LAUNCHER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def port(self, what: str) -> int | None:
        for line in list(self.lines):
            match = re.search(rf"{what} .*listening on port (\d+)", line)
            if match:
                return int(match.group(1))
        return None

    def wait_for_port(self, what: str, timeout: float = 240) -> int:
        wait_until(lambda: self.port(what) or self.process.poll() is not None, f"{what} is up", timeout)
        port = self.port(what)
        assert port is not None, self.log()
        return port

    def log(self) -> str:
        self._reader.join(0.1 if self.process.poll() is None else 5)
        return "".join(self.lines)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def launcher_env(termination_log: Path | None = None, **extra: str) -> dict[str, str]:
    """The test environment without model/port settings, ports 0 and a private termination log."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_NAME", "GRPC_PORT", "PORT")}
    # Keep startup errors out of the real /dev/termination-log when the tests run as root.
    log = termination_log or Path(tempfile.mkdtemp(prefix="tgis-test-")) / "termination-log"
    return {**env, "GRPC_PORT": "0", "PORT": "0", "TERMINATION_MESSAGE_PATH": str(log), **extra}
