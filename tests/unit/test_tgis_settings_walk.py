"""Every environment variable IBM TGIS reads is either used here or named in a start-up warning: none is
accepted and silently ignored.

The lists are TGIS's own, read from its sources (IBM/text-generation-inference): the launcher's clap
`Args` with `env` and its `env::var` calls (launcher/src/main.rs), the router's `Args` and its LOG_LEVEL
filter (router/src/main.rs), and the Python server's `os.getenv`/`os.environ` reads
(server/text_generation_server/**.py).
"""

from __future__ import annotations

import logging
import typing
from pathlib import Path

import pytest

from tgis.cli import cuda_process_defaults
from tgis.config import Settings, shard_count
from tgis.model_files.cache_dir import hub_cache_dir
from tgis.unimplemented import warn_unimplemented

LAUNCHER_ARGS = (
    "MODEL_NAME", "REVISION", "DEPLOYMENT_FRAMEWORK", "DTYPE", "DTYPE_STR", "QUANTIZE", "NUM_SHARD",
    "MAX_CONCURRENT_REQUESTS", "MAX_SEQUENCE_LENGTH", "MAX_NEW_TOKENS", "MAX_BATCH_SIZE",
    "MAX_PREFILL_PADDING", "BATCH_SAFETY_MARGIN", "MAX_WAITING_TOKENS", "PORT", "GRPC_PORT",
    "SHARD_UDS_PATH", "MASTER_ADDR", "MASTER_PORT", "JSON_OUTPUT", "TLS_CERT_PATH", "TLS_KEY_PATH",
    "TLS_CLIENT_CA_CERT_PATH", "OUTPUT_SPECIAL_TOKENS", "CUDA_PROCESS_MEMORY_FRACTION",
    "DEFAULT_INCLUDE_STOP_SEQS", "OTLP_ENDPOINT", "OTLP_SERVICE_NAME",
)  # fmt: skip
LAUNCHER_ENV_READS = (
    "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HOME", "MAX_BATCH_WEIGHT",
    "MAX_PREFILL_WEIGHT", "PYTORCH_CUDA_ALLOC_CONF", "NUM_GPUS", "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)  # fmt: skip
# MASTER_SHARD_UDS_PATH and TOKENIZER_PATH are left out: TGIS's launcher hands them to its router.
ROUTER_ARGS = ("TOKENIZATION_WORKERS", "OTEL_SERVICE_NAME", "LOG_LEVEL")
SERVER_ENV_READS = (
    "WORLD_SIZE", "RANK", "BLOOM_SLOW_BUT_EXACT", "TRUST_REMOTE_CODE", "PAGED_ATTENTION", "EXLLAMA_VERSION",
    "DISABLE_EXLLAMA", "TRANSFORMERS_ATTN_IMPL", "SPECULATOR_NAME", "SPECULATOR_REVISION",
    "SPECULATOR_N_CANDIDATES", "SPECULATOR_TOP_K_TOKENS_PER_HEAD", "SPECULATOR_MAX_BATCH_SIZE",
    "PT2_COMPILE", "PROMPT_CACHE_SIZE_MB", "PREFIX_STORE_PATH", "OPTIMIZE_ONNX_MODEL", "MERGE_ONNX_GRAPHS",
    "MAX_PROMPT_PREFIX_LENGTH", "LOG_GPU_USAGE_INTERVAL", "KV_CACHE_MANAGER_NUM_GPU_BLOCKS",
    "GPTQ_CUDA_TYPE", "FP32_LOGITS_PROCESS", "FLASH_ATTENTION", "ESTIMATE_MEMORY",
    "ESTIMATE_MEMORY_BATCH_SIZE", "ESTIMATE_MEMORY_MIN_SAMPLES", "ESTIMATE_MEMORY_START_SEQ_LEN",
    "ESTIMATE_MEMORY_STOP_SEQ_LEN", "ESTIMATE_MEMORY_FIT_THRESHOLD", "ESTIMATE_MEMORY_NEW_TOKENS",
    "ESTIMATE_MEMORY_NEW_TOKEN_SAMPLES", "DISABLE_CUSTOM_KERNELS", "DEBUG", "CUDA_PAD_TO_MULT_OF_8",
    "COMPACT_BEFORE_PREFILL", "HF_HUB_CACHE", "TRANSFORMERS_CACHE",
)  # fmt: skip
EVERY_TGIS_VARIABLE = sorted({*LAUNCHER_ARGS, *LAUNCHER_ENV_READS, *ROUTER_ARGS, *SERVER_ENV_READS})

# Values that differ from each setting's default (the rest: "true" for bools off by default, etc.).
SAMPLE_VALUES = {
    "DEPLOYMENT_FRAMEWORK": "hf_custom_tp",
    "DTYPE": "bfloat16",
    "DTYPE_STR": "bfloat16",
    "ESTIMATE_MEMORY": "manual",
    "LOG_LEVEL": "debug",
    "MAX_PREFILL_PADDING": "0.5",
    "CUDA_PROCESS_MEMORY_FRACTION": "0.5",
    "ESTIMATE_MEMORY_FIT_THRESHOLD": "0.5",
    "SPECULATOR_TOP_K_TOKENS_PER_HEAD": "4,3,2",
}
# Read from the environment outside Settings: how each is seen to take effect.
SPECIAL = {"HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "HOME",
           "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}  # fmt: skip


def settings_field(name: str) -> str | None:
    """The Settings field `name` fills, by its own name or an alias (OTLP_SERVICE_NAME)."""
    for field_name, info in Settings.model_fields.items():
        aliases = getattr(info.validation_alias, "choices", ()) if info.validation_alias else ()
        if name.lower() == field_name or name.lower() in aliases:
            return field_name
    return None


def sample_value(name: str, field_name: str) -> str:
    if name in SAMPLE_VALUES:
        return SAMPLE_VALUES[name]
    info = Settings.model_fields[field_name]
    kinds = set(typing.get_args(info.annotation)) or {info.annotation}
    if bool in kinds:
        return "false" if info.default else "true"
    if int in kinds:
        return str((info.default or 0) + 7)
    if float in kinds:
        return "0.5"
    return "/some/value"


def takes_effect(name: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    if name in {"HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE"}:
        return hub_cache_dir({name: "/cache"}) == Path("/cache")
    if name == "HF_HOME":
        return hub_cache_dir({"HF_HOME": "/home/hf"}) == Path("/home/hf/hub")
    if name == "HOME":
        monkeypatch.setenv("HOME", "/elsewhere")
        return hub_cache_dir({}) == Path("/elsewhere/.cache/huggingface/hub")
    if name in {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}:
        return shard_count(Settings(), {name: "0,1,2"}) == 3
    assert name == "PYTORCH_CUDA_ALLOC_CONF"
    environ: dict[str, str] = {}
    cuda_process_defaults(Settings(), environ)
    return environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("name", EVERY_TGIS_VARIABLE)
def test_every_tgis_variable_is_used_or_warned_about_by_name(
    name: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for other in EVERY_TGIS_VARIABLE:  # only `name` set (the suite sets DTYPE, for one)
        monkeypatch.delenv(other, raising=False)
    if name in SPECIAL:
        assert takes_effect(name, monkeypatch), name
        return
    field_name = settings_field(name)
    if field_name is not None:
        value = sample_value(name, field_name)
        monkeypatch.setenv(name, value)
        read = getattr(Settings(), field_name)
        assert read != Settings.model_fields[field_name].default, (name, value, read)
        return
    with caplog.at_level(logging.WARNING, logger="tgis.unimplemented"):
        warn_unimplemented({name: "1"})
    assert any(message.startswith(f"{name}=1 ") for message in caplog.messages), name
