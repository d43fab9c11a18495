"""`tgis-bench`: every tool is a subcommand reaching its own parser; `text-generation-server benchmark`
runs it with the same arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tgis_bench import cli

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_subcommand_reaches_its_own_parser(command: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "configure_logging", lambda: None)  # keep pytest's log capture in place
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: tgis-bench {command}" in capsys.readouterr().out


def test_a_command_is_required(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "usage: tgis-bench" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", [["tgis-bench", "--help"], ["text-generation-server", "benchmark", "--help"]]
)
def test_the_installed_commands_list_the_subcommands(command: list[str]) -> None:
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: tgis-bench")
    assert all(name in result.stdout for name in cli.COMMANDS)
