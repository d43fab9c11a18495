"""TGIS launcher flags that used to crash the parser: short flags, --otlp-service-name,
--shard-uds-path, and --version on both commands."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tgis import __version__
from tgis.cli import load_settings
from tgis.config import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.delenv("OTLP_SERVICE_NAME", raising=False)


def test_tgis_short_flags() -> None:
    s = load_settings(["-p", "3111", "-g", "8111", "-c", "0.5"], "text-generation-launcher")
    assert (s.port, s.grpc_port, s.cuda_process_memory_fraction) == (3111, 8111, 0.5)


def test_otlp_service_name_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    flag = load_settings(["--otlp-service-name", "svc-a"], "text-generation-launcher")
    assert flag.otel_service_name == "svc-a"
    monkeypatch.setenv("OTLP_SERVICE_NAME", "svc-b")
    assert load_settings([], "text-generation-launcher").otel_service_name == "svc-b"


def test_shard_uds_path_is_accepted_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    s = load_settings(["--shard-uds-path", "/run/text-generation-server"], "text-generation-launcher")
    with caplog.at_level(logging.WARNING, logger="tgis.config"):
        s.warn_legacy()
    assert len(caplog.messages) == 1
    assert caplog.messages[0].startswith(
        "SHARD_UDS_PATH=/run/text-generation-server is accepted but not used"
    )


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("launcher_main", "text-generation-launcher"),
        ("server_main", "text-generation-server"),
    ],
)
def test_version(command: str, expected: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.argv[0] = '{expected}'; from tgis.cli import {command}; {command}()",
            "--version",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{expected} {__version__}"


def test_a_settings_error_is_a_json_line_when_json_output_was_asked(monkeypatch, capsys, tmp_path) -> None:
    """The settings that failed to load cannot say JSON_OUTPUT, so the raw value decides."""
    import json

    from tgis import cli

    assert cli.json_output_asked([], {"JSON_OUTPUT": "true"})
    assert cli.json_output_asked(["--json-output"], {})
    assert cli.json_output_asked(["--json-output", "--port", "1"], {})
    assert not cli.json_output_asked(["--json-output=false"], {"JSON_OUTPUT": "true"})
    assert not cli.json_output_asked([], {"JSON_OUTPUT": "no"})
    monkeypatch.setenv("JSON_OUTPUT", "1")
    monkeypatch.setenv("MAX_BATCH_SIZE", "abc")
    monkeypatch.setenv("TERMINATION_MESSAGE_PATH", str(tmp_path / "termination-log"))
    assert cli.run_server([], "text-generation-launcher") == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["level"] == "CRITICAL" and "MAX_BATCH_SIZE" in record["message"]


def test_benchmark_runs_the_tgis_bench_tool_with_the_same_arguments(monkeypatch) -> None:
    import importlib.util

    from tgis import cli

    ran: list[list[str]] = []

    def execv(path: str, args: list[str]) -> None:
        ran.append(args)
        raise SystemExit(0)

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: object() if name == "tgis_bench" else real(name)
    )
    monkeypatch.setattr(cli.os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["text-generation-server", "benchmark", "run", "--help"])
    with pytest.raises(SystemExit):
        cli.server_main()
    assert ran == [[sys.executable, "-m", "tgis_bench", "run", "--help"]]


def test_benchmark_without_the_tool_says_how_to_install_it(monkeypatch, capsys) -> None:
    import importlib.util

    from tgis import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "tgis_bench" else real(name)
    )
    monkeypatch.setattr(sys, "argv", ["text-generation-server", "benchmark", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.server_main()
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "pip install -e ./bench" in lines[0] and "tgis-bench --help" in lines[0]


@pytest.mark.parametrize("tool", ["build-bench-model", "profile-step", "compare-runs", "paired-runs"])
def test_the_other_benchmark_tools_are_tgis_bench_subcommands_only(tool: str, monkeypatch, capsys) -> None:
    from tgis import cli

    monkeypatch.setattr(sys, "argv", ["text-generation-server", tool, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli.server_main()
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
