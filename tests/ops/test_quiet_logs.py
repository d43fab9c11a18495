"""What the launcher logs while it starts: one line with the version and the effective settings (no
secrets), and no progress bars or gRPC C-core lines."""

from __future__ import annotations

import re
import signal

from tests.launcher import launcher_env
from tgis import __version__
from tgis.logs import quiet_libraries

OWN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


def test_quiet_defaults_never_override_an_operators_value() -> None:
    environ = {"GRPC_VERBOSITY": "DEBUG"}
    quiet_libraries(environ)
    assert environ == {"GRPC_VERBOSITY": "DEBUG", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def test_startup_logs_one_settings_line_and_no_progress_bars(launched, model_dirs, tmp_path) -> None:
    run = launched(
        launcher_env(MODEL_NAME=str(model_dirs("gpt2")), API_KEY="sekrit-value", GRPC_TRACE="api"),
        "--max-batch-size",
        "3",
    )
    run.wait_for_port("HTTP server")
    run.process.send_signal(signal.SIGTERM)
    assert run.process.wait(120) == 0
    log = run.log()
    starting = [line for line in log.splitlines() if f"tgis {__version__} starting with " in line]
    assert len(starting) == 1, log
    assert f"model_name={model_dirs('gpt2')}" in starting[0]
    assert "max_batch_size=3" in starting[0]
    assert "api_key=***" in starting[0]
    assert "sekrit-value" not in log
    assert "max_new_tokens=" in starting[0] and "max_new_tokens=***" not in starting[0]


def test_serving_logs_no_progress_bars_nor_grpc_core_lines(launched, model_dirs) -> None:
    run = launched(launcher_env(MODEL_NAME=str(model_dirs("gpt2")), GRPC_TRACE="api"))
    run.wait_for_port("HTTP server")
    run.kill()
    log = run.log()
    assert "it/s]" not in log and "Loading weights" not in log, log
    # Every line is the server's own (gRPC C-core traces, e.g. `I0000 00:00:...`, or bars are not).
    strays = [line for line in log.splitlines() if not OWN_LINE.match(line)]
    assert strays == [], log
