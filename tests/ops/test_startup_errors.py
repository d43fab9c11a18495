"""Operator errors at startup end with one clear line, no traceback, a non-zero exit and the same line
in the termination log (SPEC §9.4)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launcher import Launched, launcher_env
from tests.ops.certs import make_ca, make_leaf
from tgis import cli
from tgis.config import Settings

CLEARED_ENV = (
    "HF_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HOME",
    "CUDA_VISIBLE_DEVICES",
)


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    ca = make_ca("ca")
    cert, key = make_leaf(ca, "localhost", server=True).write(tmp_path, "server")
    ca_path = tmp_path / "ca.crt"
    ca_path.write_bytes(ca.cert_pem)
    return cert, key, ca_path


@pytest.fixture
def start_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Callable[..., tuple[int, list[str], str]]:
    """`start(*flags, **env)` runs the launcher's code in this process and returns
    (exit code, stderr lines, termination log)."""
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
    for name in CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"):  # the launcher sets them
        monkeypatch.setenv(name, "restored after the test")
        monkeypatch.delenv(name)
    termination_log = tmp_path / "termination-log"
    monkeypatch.setenv("TERMINATION_MESSAGE_PATH", str(termination_log))
    monkeypatch.setattr(cli, "configure_logging", lambda *args, **kwargs: None)

    def start(*flags: str, **env: str) -> tuple[int, list[str], str]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code = cli.run_server(["--port", "0", "--grpc-port", "0", *flags], "text-generation-launcher")
        stderr = capsys.readouterr().err
        assert "Traceback" not in stderr
        logged = termination_log.read_text() if termination_log.exists() else ""
        return code, stderr.splitlines(), logged

    return start


def assert_one_clear_line(result: tuple[int, list[str], str], message: str) -> None:
    code, lines, logged = result
    assert code == 1
    assert [line for line in lines if "ERROR" in line] == [f"ERROR: {message}"]
    assert logged == message + "\n"


def test_conflicting_dtype_variables(start_in_process) -> None:
    result = start_in_process(DTYPE="float16", DTYPE_STR="float32")
    assert_one_clear_line(result, "dtype and dtype_str args both provided with different values")


def test_conflicting_shard_counts(start_in_process) -> None:
    result = start_in_process(NUM_GPUS="2", NUM_SHARD="1")
    assert_one_clear_line(result, "NUM_GPUS and num_shard are set to different values (2 and 1)")


def test_conflicting_cache_variables(start_in_process, tmp_path: Path) -> None:
    result = start_in_process(
        MODEL_NAME="acme/tiny", HF_HUB_CACHE=str(tmp_path / "a"), TRANSFORMERS_CACHE=str(tmp_path / "b")
    )
    assert_one_clear_line(
        result, "TRANSFORMERS_CACHE and HF_HUB_CACHE env vars can't be set to different values"
    )


def test_missing_model(start_in_process, tmp_path: Path) -> None:
    result = start_in_process(MODEL_NAME=str(tmp_path / "nothing-here"))
    assert_one_clear_line(result, f"Model {tmp_path / 'nothing-here'} not found: no such directory")


def test_unknown_dtype(start_in_process, model_dirs) -> None:
    result = start_in_process("--dtype", "float17", MODEL_NAME=str(model_dirs("gpt2")))
    assert_one_clear_line(
        result,
        "Unrecognized data type: float17 "
        "(DTYPE is one of float16, bfloat16, float32, float64, half, float, double, or int8)",
    )


def test_more_than_one_speculator_candidate(start_in_process, model_dirs) -> None:
    result = start_in_process(MODEL_NAME=str(model_dirs("gpt2")), SPECULATOR_N_CANDIDATES="3")
    assert_one_clear_line(
        result,
        "SPECULATOR_N_CANDIDATES=3: this server verifies one candidate chain per sequence and step; "
        "set it to 1 or leave it unset",
    )


def test_speculation_on_a_model_served_in_padded_batches(start_in_process, model_dirs) -> None:
    result = start_in_process(
        MODEL_NAME=str(model_dirs("gpt2")), SPECULATOR_NAME="ngram", PAGED_ATTENTION="false"
    )
    assert_one_clear_line(
        result,
        "SPECULATOR_NAME=ngram needs the paged step, and this model runs padded batches (see the log line "
        "on the paged step above)",
    )


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("CUDA_PROCESS_MEMORY_FRACTION", "1.5", "cuda_process_memory_fraction must be in range 0 < x <= 1"),
        ("CUDA_PROCESS_MEMORY_FRACTION", "0", "cuda_process_memory_fraction must be in range 0 < x <= 1"),
        (
            "MAX_PREFILL_PADDING",
            "1.5",
            "max_prefill_padding (1.5) must be a percentage in the range [0.0, 1.0]",
        ),
        ("MAX_NEW_TOKENS", "0", "max_new_tokens (0) at least 1"),
        ("MAX_SEQUENCE_LENGTH", "1", "max_sequence_length (1) must be at least 2 (1 input + 1 output)"),
        ("MAX_CONCURRENT_REQUESTS", "0", "max_concurrent_requests must be > 0"),
        ("TOKENIZATION_WORKERS", "0", "tokenization_workers must be > 0"),
        ("NUM_GPUS", "0", "`num_shard` / NUM_GPUS cannot be < 1"),
    ],
)
def test_tgis_range_checks_fail_with_tgis_messages(start_in_process, variable, value, message) -> None:
    assert_one_clear_line(start_in_process(**{variable: value}), message)


def test_half_configured_tls(start_in_process, tls_files, model_dirs) -> None:
    cert, _, _ = tls_files
    result = start_in_process(MODEL_NAME=str(model_dirs("gpt2")), TLS_CERT_PATH=str(cert))
    assert_one_clear_line(
        result, "tls: must provide both cert and key (TLS_CERT_PATH is set, TLS_KEY_PATH is not)"
    )


def test_client_ca_without_key_pair(start_in_process, tls_files, model_dirs) -> None:
    _, _, ca = tls_files
    result = start_in_process(MODEL_NAME=str(model_dirs("gpt2")), TLS_CLIENT_CA_CERT_PATH=str(ca))
    assert_one_clear_line(result, "tls: cannot provide client ca cert without keypair")


def test_unreadable_tls_key(start_in_process, tls_files, model_dirs, tmp_path: Path) -> None:
    cert, _, _ = tls_files
    missing = tmp_path / "gone.key"
    result = start_in_process(
        MODEL_NAME=str(model_dirs("gpt2")), TLS_CERT_PATH=str(cert), TLS_KEY_PATH=str(missing)
    )
    assert_one_clear_line(result, f"couldn't load key from {missing}")


def test_grpc_port_in_use(start_in_process, listening: int, model_dirs) -> None:
    result = start_in_process("--grpc-port", str(listening), MODEL_NAME=str(model_dirs("gpt2")))
    assert_one_clear_line(result, f"gRPC port {listening} is already in use")


def test_http_port_in_use(start_in_process, listening: int, model_dirs) -> None:
    result = start_in_process("--port", str(listening), MODEL_NAME=str(model_dirs("gpt2")))
    assert_one_clear_line(result, f"HTTP port {listening} is already in use")


# ---------------------------------------------------------------- the real process


def test_the_launcher_process_exits_non_zero_with_one_line_and_a_termination_message(
    launched: Callable[..., Launched], listening: int, model_dirs, tmp_path: Path
) -> None:
    # The real process, as operators run it: one line, exit code 1 and the termination message.
    termination_log = tmp_path / "termination-log"
    message = f"gRPC port {listening} is already in use"
    env = launcher_env(termination_log, MODEL_NAME=str(model_dirs("gpt2")), GRPC_PORT=str(listening))
    run = launched(env)
    assert run.process.wait(120) == 1
    log = run.log()
    assert [line for line in log.splitlines() if "ERROR" in line] == [f"ERROR: {message}"]
    assert "Traceback" not in log
    assert termination_log.read_text() == message + "\n"
