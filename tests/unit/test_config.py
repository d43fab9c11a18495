"""Settings from env vars, derived serving limits and the HF cache location (SPEC §9.1–§9.2)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pydantic
import pytest

from tgis.config import (
    DEFAULT_MAX_SEQUENCE_LENGTH,
    SEQUENCE_LENGTH_CONFIG_KEYS,
    ServingLimits,
    Settings,
    effective_limits,
    model_max_sequence_length,
)
from tgis.model_files.cache_dir import hub_cache_dir

HF_CACHE_ENV = ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No setting may leak in from the environment the tests run in."""
    for name in Settings.model_fields:
        monkeypatch.delenv(name.upper(), raising=False)
        monkeypatch.delenv(name, raising=False)
    for name in HF_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- defaults (§9.1)


def test_defaults_match_the_spec() -> None:
    s = Settings()
    assert s.model_name is None
    assert s.revision == "main"
    assert s.deployment_framework == "hf_transformers"
    assert s.dtype is None and s.dtype_str is None and s.dtype_name is None
    assert s.quantize is None
    assert s.num_gpus is None and s.num_shard is None
    assert s.max_sequence_length is None
    assert s.max_new_tokens == 1024
    assert s.max_batch_size == 12
    assert s.max_concurrent_requests == 512
    assert s.max_waiting_tokens == 24
    assert s.max_prefill_padding == 0.2
    assert s.batch_safety_margin == 20
    assert s.estimate_memory == "auto"
    assert s.max_batch_weight is None and s.max_prefill_weight is None
    assert s.port == 3000
    assert s.grpc_port == 8033
    assert s.tls_cert_path is None and s.tls_key_path is None and s.tls_client_ca_cert_path is None
    assert s.output_special_tokens is False
    assert s.default_include_stop_seqs is True
    assert s.prefix_store_path is None
    assert s.prompt_cache_size_mb == 512
    assert s.max_prompt_prefix_length is None
    assert s.trust_remote_code is False
    assert s.flash_attention is False and s.paged_attention is None and s.pt2_compile is False
    assert s.cuda_process_memory_fraction == 1.0
    assert s.tokenization_workers is None
    assert s.json_output is False
    assert s.log_level == "info"
    assert s.otlp_endpoint is None
    assert s.otel_service_name == "text-generation-inference.router"
    assert s.master_addr == "localhost"
    assert s.master_port == 29500


# ---------------------------------------------------------------- env var names


@pytest.mark.parametrize(
    ("env", "value", "field", "expected"),
    [
        ("MODEL_NAME", "org/model", "model_name", "org/model"),
        ("REVISION", "v2", "revision", "v2"),
        ("DEPLOYMENT_FRAMEWORK", "hf_accelerate", "deployment_framework", "hf_accelerate"),
        ("DTYPE", "bfloat16", "dtype", "bfloat16"),
        ("DTYPE_STR", "float32", "dtype_str", "float32"),
        ("QUANTIZE", "gptq", "quantize", "gptq"),
        ("NUM_GPUS", "2", "num_gpus", 2),
        ("NUM_SHARD", "4", "num_shard", 4),
        ("MAX_SEQUENCE_LENGTH", "512", "max_sequence_length", 512),
        ("MAX_NEW_TOKENS", "169", "max_new_tokens", 169),
        ("MAX_BATCH_SIZE", "3", "max_batch_size", 3),
        ("MAX_CONCURRENT_REQUESTS", "7", "max_concurrent_requests", 7),
        ("MAX_WAITING_TOKENS", "10", "max_waiting_tokens", 10),
        ("MAX_PREFILL_PADDING", "0.5", "max_prefill_padding", 0.5),
        ("BATCH_SAFETY_MARGIN", "35", "batch_safety_margin", 35),
        ("ESTIMATE_MEMORY", "manual", "estimate_memory", "manual"),
        ("MAX_BATCH_WEIGHT", "1000", "max_batch_weight", 1000),
        ("MAX_PREFILL_WEIGHT", "2000", "max_prefill_weight", 2000),
        ("PORT", "3001", "port", 3001),
        ("GRPC_PORT", "9033", "grpc_port", 9033),
        ("TLS_CERT_PATH", "/tls/cert.pem", "tls_cert_path", "/tls/cert.pem"),
        ("TLS_KEY_PATH", "/tls/key.pem", "tls_key_path", "/tls/key.pem"),
        ("TLS_CLIENT_CA_CERT_PATH", "/tls/ca.pem", "tls_client_ca_cert_path", "/tls/ca.pem"),
        ("OUTPUT_SPECIAL_TOKENS", "true", "output_special_tokens", True),
        ("DEFAULT_INCLUDE_STOP_SEQS", "false", "default_include_stop_seqs", False),
        ("PREFIX_STORE_PATH", "/prefixes", "prefix_store_path", "/prefixes"),
        ("PROMPT_CACHE_SIZE_MB", "64", "prompt_cache_size_mb", 64),
        ("MAX_PROMPT_PREFIX_LENGTH", "16", "max_prompt_prefix_length", 16),
        ("TRUST_REMOTE_CODE", "true", "trust_remote_code", True),
        ("FLASH_ATTENTION", "true", "flash_attention", True),
        ("PAGED_ATTENTION", "true", "paged_attention", True),
        ("PT2_COMPILE", "true", "pt2_compile", True),
        ("CUDA_PROCESS_MEMORY_FRACTION", "0.5", "cuda_process_memory_fraction", 0.5),
        ("TOKENIZATION_WORKERS", "3", "tokenization_workers", 3),
        ("JSON_OUTPUT", "true", "json_output", True),
        ("LOG_LEVEL", "debug", "log_level", "debug"),
        ("OTLP_ENDPOINT", "http://otel:4317", "otlp_endpoint", "http://otel:4317"),
        ("OTEL_SERVICE_NAME", "svc", "otel_service_name", "svc"),
        ("MASTER_ADDR", "10.0.0.1", "master_addr", "10.0.0.1"),
        ("MASTER_PORT", "29600", "master_port", 29600),
        ("TRANSFORMERS_ATTN_IMPL", "sdpa", "transformers_attn_impl", "sdpa"),
    ],
)
def test_setting_is_read_from_its_upper_case_env_var(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str, expected: object
) -> None:
    monkeypatch.setenv(env, value)
    assert getattr(Settings(), field) == expected


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False), ("1", True), ("0", False)])
def test_booleans_accept_true_false_and_one_zero(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.setenv("TRUST_REMOTE_CODE", value)
    assert Settings().trust_remote_code is expected


def test_constructor_arguments_work_without_env() -> None:
    s = Settings(max_batch_size=3, grpc_port=0)
    assert s.max_batch_size == 3
    assert s.grpc_port == 0


@pytest.mark.parametrize("env", ["MODEL_NAME", "DTYPE", "DTYPE_STR", "QUANTIZE"])
def test_empty_string_env_means_unset(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv(env, "")
    assert getattr(Settings(), env.lower()) is None


# ---------------------------------------------------------------- framework alias


def test_tgis_native_is_an_alias_of_hf_custom_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEPLOYMENT_FRAMEWORK", "tgis_native")
    assert Settings().deployment_framework == "hf_custom_tp"


def test_hf_custom_tp_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEPLOYMENT_FRAMEWORK", "hf_custom_tp")
    assert Settings().deployment_framework == "hf_custom_tp"


# ---------------------------------------------------------------- conflicts and bounds


def test_dtype_and_dtype_str_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTYPE", "float16")
    monkeypatch.setenv("DTYPE_STR", "bfloat16")
    with pytest.raises(pydantic.ValidationError, match="dtype and dtype_str args both provided"):
        Settings()


def test_matching_dtype_and_dtype_str_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTYPE", "bfloat16")
    monkeypatch.setenv("DTYPE_STR", "bfloat16")
    assert Settings().dtype_name == "bfloat16"


@pytest.mark.parametrize("env", ["DTYPE", "DTYPE_STR"])
def test_dtype_name_reads_either_variable(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv(env, "float32")
    assert Settings().dtype_name == "float32"


def test_num_gpus_and_num_shard_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUM_GPUS", "2")
    monkeypatch.setenv("NUM_SHARD", "4")
    with pytest.raises(
        pydantic.ValidationError, match=r"NUM_GPUS and num_shard are set to different values \(2 and 4\)"
    ):
        Settings()


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("MAX_SEQUENCE_LENGTH", "1"),
        ("MAX_NEW_TOKENS", "0"),
        ("MAX_CONCURRENT_REQUESTS", "0"),
        ("MAX_BATCH_SIZE", "0"),
        ("MAX_PREFILL_PADDING", "1.5"),
        ("MAX_PREFILL_PADDING", "-0.1"),
        ("BATCH_SAFETY_MARGIN", "101"),
        ("BATCH_SAFETY_MARGIN", "-1"),
        ("ESTIMATE_MEMORY", "sometimes"),
        ("TOKENIZATION_WORKERS", "0"),
        ("CUDA_PROCESS_MEMORY_FRACTION", "0"),
        ("CUDA_PROCESS_MEMORY_FRACTION", "1.5"),
        ("NUM_GPUS", "0"),
        ("GRPC_PORT", "70000"),
        ("MAX_BATCH_SIZE", "many"),
    ],
)
def test_out_of_range_settings_are_rejected(monkeypatch: pytest.MonkeyPatch, env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(pydantic.ValidationError):
        Settings()


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("MAX_SEQUENCE_LENGTH", "2"),
        ("MAX_PREFILL_PADDING", "0"),
        ("MAX_PREFILL_PADDING", "1"),
        ("BATCH_SAFETY_MARGIN", "100"),
    ],
)
def test_boundary_settings_are_accepted(monkeypatch: pytest.MonkeyPatch, env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    Settings()


def test_legacy_weights_are_accepted_and_warned_about(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAX_BATCH_WEIGHT", "5")
    monkeypatch.setenv("MAX_PREFILL_WEIGHT", "7")
    with caplog.at_level(logging.WARNING, logger="tgis.config"):
        Settings().warn_legacy()
    assert "MAX_BATCH_WEIGHT is set to 5 but this parameter will be ignored." in caplog.messages
    assert "MAX_PREFILL_WEIGHT is set to 7 but this parameter will be ignored." in caplog.messages


def test_no_legacy_warning_when_unset(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tgis.config"):
        Settings().warn_legacy()
    assert caplog.messages == []


# ---------------------------------------------------------------- derived limits (§9.2)


def test_model_sequence_length_keys_in_spec_order() -> None:
    assert SEQUENCE_LENGTH_CONFIG_KEYS == (
        "max_position_embeddings",
        "n_positions",
        "max_seq_len",
        "seq_length",
        "max_sequence_length",
        "max_seq_length",
        "seq_len",
    )


@pytest.mark.parametrize("key", SEQUENCE_LENGTH_CONFIG_KEYS)
def test_model_sequence_length_from_any_known_key(key: str) -> None:
    assert model_max_sequence_length({key: 333}) == 333


def test_first_known_key_wins() -> None:
    config = {"seq_len": 1, "n_positions": 1024, "max_position_embeddings": 4096}
    assert model_max_sequence_length(config) == 4096
    assert model_max_sequence_length({"seq_len": 1, "max_seq_len": 77, "seq_length": 88}) == 77


def test_first_integer_key_wins_over_non_integers() -> None:
    config = {"max_position_embeddings": None, "n_positions": "1024", "max_seq_len": True, "seq_length": 600}
    assert model_max_sequence_length(config) == 600


def test_model_sequence_length_falls_back_to_2048() -> None:
    assert DEFAULT_MAX_SEQUENCE_LENGTH == 2048
    assert model_max_sequence_length({}) == 2048
    assert model_max_sequence_length({"hidden_size": 64, "max_length": 20}) == 2048


def test_setting_wins_over_model_config() -> None:
    limits = effective_limits(Settings(max_sequence_length=200, max_new_tokens=169), {"n_positions": 1024})
    assert limits == ServingLimits(max_sequence_length=200, max_new_tokens=169)


def test_setting_above_model_limit_is_used_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tgis.config"):
        limits = effective_limits(Settings(max_sequence_length=4096), {"n_positions": 1024})
    assert limits.max_sequence_length == 4096
    assert any("4096" in message and "1024" in message for message in caplog.messages)


def test_model_config_used_without_setting() -> None:
    limits = effective_limits(Settings(), {"max_position_embeddings": 4096})
    assert limits == ServingLimits(max_sequence_length=4096, max_new_tokens=1024)


def test_limits_fall_back_to_2048_without_setting_or_config_key() -> None:
    assert effective_limits(Settings(), {}) == ServingLimits(max_sequence_length=2048, max_new_tokens=1024)


def test_max_new_tokens_below_sequence_length_is_kept() -> None:
    assert effective_limits(Settings(max_new_tokens=255), {"n_positions": 256}).max_new_tokens == 255


@pytest.mark.parametrize("max_new", [256, 1024])
def test_max_new_tokens_at_or_above_sequence_length_becomes_length_minus_one(
    caplog: pytest.LogCaptureFixture, max_new: int
) -> None:
    with caplog.at_level(logging.WARNING, logger="tgis.config"):
        limits = effective_limits(Settings(max_new_tokens=max_new), {"n_positions": 256})
    assert limits.max_new_tokens == 255
    assert caplog.messages


def test_default_max_new_tokens_clamped_for_short_models() -> None:
    # Default MAX_NEW_TOKENS 1024 with a 256-position model.
    assert effective_limits(Settings(), {"n_positions": 256}) == ServingLimits(256, 255)


def test_limits_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_SEQUENCE_LENGTH", "200")
    monkeypatch.setenv("MAX_NEW_TOKENS", "169")
    assert effective_limits(Settings(), {"n_positions": 256}) == ServingLimits(200, 169)


def test_minimal_sequence_length_leaves_one_new_token() -> None:
    assert effective_limits(Settings(max_sequence_length=2), {}) == ServingLimits(2, 1)


# ---------------------------------------------------------------- HF hub cache (§9.1)


def test_hub_cache_default_is_under_home() -> None:
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_hub_cache_from_hf_home() -> None:
    assert hub_cache_dir({"HF_HOME": "/data/hf"}) == Path("/data/hf/hub")


def test_hf_hub_cache_wins_over_hf_home() -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": "/cache", "HF_HOME": "/data/hf"}) == Path("/cache")


@pytest.mark.parametrize("alias", ["TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE"])
def test_deprecated_alias_is_used_with_a_warning(caplog: pytest.LogCaptureFixture, alias: str) -> None:
    with caplog.at_level(logging.WARNING, logger="tgis.model_files.cache_dir"):
        assert hub_cache_dir({alias: "/old/cache", "HF_HOME": "/data/hf"}) == Path("/old/cache")
    assert any(alias in message for message in caplog.messages)


def test_agreeing_aliases_are_accepted() -> None:
    environ = {"HF_HUB_CACHE": "/c", "TRANSFORMERS_CACHE": "/c", "HUGGINGFACE_HUB_CACHE": "/c"}
    assert hub_cache_dir(environ) == Path("/c")


def test_empty_alias_is_ignored() -> None:
    assert hub_cache_dir({"HF_HUB_CACHE": "/c", "TRANSFORMERS_CACHE": ""}) == Path("/c")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"HF_HUB_CACHE": "/a", "TRANSFORMERS_CACHE": "/b"},
            "TRANSFORMERS_CACHE and HF_HUB_CACHE env vars can't be set to different values",
        ),
        (
            {"HF_HUB_CACHE": "/a", "HUGGINGFACE_HUB_CACHE": "/b"},
            "HUGGINGFACE_HUB_CACHE and HF_HUB_CACHE env vars can't be set to different values",
        ),
        (
            {"TRANSFORMERS_CACHE": "/a", "HUGGINGFACE_HUB_CACHE": "/b"},
            "HUGGINGFACE_HUB_CACHE and TRANSFORMERS_CACHE env vars can't be set to different values",
        ),
        (
            {"HF_HUB_CACHE": "/a", "TRANSFORMERS_CACHE": "/a", "HUGGINGFACE_HUB_CACHE": "/b"},
            "HUGGINGFACE_HUB_CACHE and HF_HUB_CACHE env vars can't be set to different values",
        ),
    ],
)
def test_conflicting_cache_vars_are_rejected(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        hub_cache_dir(environ)
    assert str(caught.value) == message


def test_hub_cache_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", "/from/env")
    monkeypatch.setenv("TRANSFORMERS_CACHE", "/other")
    with pytest.raises(ValueError) as caught:
        hub_cache_dir(os.environ)
    expected = "TRANSFORMERS_CACHE and HF_HUB_CACHE env vars can't be set to different values"
    assert str(caught.value) == expected
    monkeypatch.delenv("TRANSFORMERS_CACHE")
    assert hub_cache_dir(os.environ) == Path("/from/env")
