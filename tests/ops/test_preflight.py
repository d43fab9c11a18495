"""Cheap setting mistakes fail at once, before torch is imported: one ERROR line, exit code 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tgis.config import Settings
from tgis.preflight import DTYPE_NAMES, ENGINE_NAMES

# Runs the launcher's code and reports whether torch had been imported by the time it returned.
SCRIPT = (
    "import sys\n"
    "from tgis.cli import run_server\n"
    "code = run_server(sys.argv[1:], 'text-generation-launcher')\n"
    "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
    "sys.exit(code)\n"
)


def launch(tmp_path: Path, *flags: str, **env: str) -> tuple[int, list[str], str]:
    base = {
        name: value
        for name, value in os.environ.items()
        if name.lower() not in Settings.model_fields and not name.startswith(("HF_", "TLS_"))
    }
    base.update(
        HF_HUB_CACHE=str(tmp_path / "hub"), TERMINATION_MESSAGE_PATH=str(tmp_path / "termination-log"), **env
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, "--port", "0", "--grpc-port", "0", *flags],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, errors, done.stdout.strip()


def assert_fails_fast(result: tuple[int, list[str], str], message: str) -> None:
    code, errors, stdout = result
    assert code == 1, errors
    assert errors == [f"ERROR: {message}"]
    assert stdout == "torch not imported"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_bad_dtype_lists_the_valid_names(tmp_path: Path, model_dir: Path) -> None:
    result = launch(tmp_path, MODEL_NAME=str(model_dir), DTYPE="fp16")
    assert_fails_fast(
        result, f"Unrecognized data type: fp16 (DTYPE is one of {', '.join(DTYPE_NAMES)}, or int8)"
    )


def test_unknown_engine(tmp_path: Path, model_dir: Path) -> None:
    result = launch(tmp_path, MODEL_NAME=str(model_dir), DEPLOYMENT_FRAMEWORK="hf_accelerat")
    available = ", ".join(sorted(ENGINE_NAMES))
    assert_fails_fast(
        result, f"DEPLOYMENT_FRAMEWORK hf_accelerat is not available in this build (available: {available})"
    )


def test_grpc_port_in_use(tmp_path: Path, model_dir: Path, listening: int) -> None:
    result = launch(tmp_path, "--grpc-port", str(listening), MODEL_NAME=str(model_dir))
    assert_fails_fast(result, f"gRPC port {listening} is already in use")


def test_http_port_in_use(tmp_path: Path, model_dir: Path, listening: int) -> None:
    result = launch(tmp_path, "--port", str(listening), MODEL_NAME=str(model_dir))
    assert_fails_fast(result, f"HTTP port {listening} is already in use")


def test_half_configured_tls_names_both_variables(tmp_path: Path, model_dir: Path) -> None:
    key = tmp_path / "server.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    result = launch(tmp_path, MODEL_NAME=str(model_dir), TLS_KEY_PATH=str(key))
    assert_fails_fast(
        result, "tls: must provide both cert and key (TLS_KEY_PATH is set, TLS_CERT_PATH is not)"
    )


def test_unreadable_tls_file(tmp_path: Path, model_dir: Path) -> None:
    missing = tmp_path / "gone.crt"
    key = tmp_path / "server.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    result = launch(tmp_path, MODEL_NAME=str(model_dir), TLS_CERT_PATH=str(missing), TLS_KEY_PATH=str(key))
    assert_fails_fast(result, f"couldn't load cert from {missing}")


def test_missing_model_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    result = launch(tmp_path, MODEL_NAME=str(missing))
    assert_fails_fast(result, f"Model {missing} not found: no such directory")


def test_directory_without_config(tmp_path: Path) -> None:
    empty = tmp_path / "weights-only"
    empty.mkdir()
    result = launch(tmp_path, MODEL_NAME=str(empty))
    assert_fails_fast(result, f"Model {empty} not found: the directory {empty} has no config.json")


def test_hub_id_not_in_cache_names_the_cache_and_the_download_command(tmp_path: Path) -> None:
    result = launch(tmp_path, MODEL_NAME="acme/not-cached")
    assert_fails_fast(
        result,
        f"Model acme/not-cached not found: looked for revision main in the HF cache at {tmp_path / 'hub'} "
        "(HF_HUB_CACHE); fetch it with `text-generation-server download-weights acme/not-cached`",
    )


def test_engine_names_match_the_registry() -> None:
    from engines.registry import ENGINES

    assert set(ENGINE_NAMES) == set(ENGINES)
