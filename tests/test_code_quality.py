"""The tree stays ruff- and mypy-clean: CI runs the linters through the test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy", "tgis", "engines", "tests", "setup.py"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_linter_is_clean(command: list[str]) -> None:
    result = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
