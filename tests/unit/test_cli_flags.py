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
