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
        ["mypy", "tgis", "engines", "tests", "bench", "setup.py"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_linter_is_clean(command: list[str]) -> None:
    result = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


MAX_MODULE_LINES = 400


def test_no_module_is_over_the_line_limit() -> None:
    """Modules stay small enough to read whole: split one that grows past the limit by what it owns."""
    generated = ROOT / "tgis" / "pb"  # protoc output
    packages = [ROOT / "tgis", ROOT / "engines", ROOT / "bench" / "tgis_bench"]
    modules = [p for package in packages for p in package.rglob("*.py") if generated not in p.parents]
    assert len(modules) > 100
    long = {
        str(p.relative_to(ROOT)): n
        for p in modules
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"over {MAX_MODULE_LINES} lines: {long}"
