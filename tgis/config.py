"""Every operator setting (env var ↔ launcher flag), validated once at startup (SPEC §9)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tgis.errors import StartupError

logger = logging.getLogger(__name__)

SEQUENCE_LENGTH_CONFIG_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
DEFAULT_MAX_SEQUENCE_LENGTH = 2048
QUANTIZE_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel takes
FRAMEWORK_ALIASES = {"tgis_native": "hf_custom_tp"}
# Within Kubernetes' 120 s pod grace: in-flight calls get this long, the rest is for shutting down.
DEFAULT_SHUTDOWN_GRACE_SECONDS = 90.0


class Settings(BaseSettings):
    """Server settings; each field is read from the env var of the same name in upper case."""

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", populate_by_name=True)

    model_name: str | None = Field(
        None, description="Hub id (resolved in the local cache), absolute dir, or `demo` (the demo model)"
    )
    require_model_name: bool = Field(
        False, description="Unset MODEL_NAME: refuse to start, not serve the demo model (the image sets it)"
    )
    revision: str = Field("main", description="Model revision looked up in the HF cache")
    deployment_framework: str = Field("hf_transformers", description="Engine (SPEC §7)")
    dtype: str | None = Field(
        None,
        description="torch dtype name; default on CUDA float16, bfloat16 for a bfloat16 checkpoint; on CPU "
        "bfloat16 where native, else float32",
    )
    dtype_str: str | None = Field(None, description="Alias of DTYPE; both set must agree")
    quantize: str | None = Field(
        None,
        description="int8 or int4: quantize at load (eetq, bitsandbytes mean int8); gptq, awq, "
        "compressed-tensors: a checkpoint quantized so (its quantization_config rules)",
    )
    quantize_group_size: int = Field(
        128,
        description="QUANTIZE=int4: input features per group (32, 64, 128, 256), each with a scale and zero",
    )
    # The ranges TGIS checks itself are checked in `_tgis_ranges`, with TGIS's own messages.
    num_gpus: int | None = Field(None, description="Shard count (≥ 1)")
    num_shard: int | None = Field(None, description="Shard count, alias of NUM_GPUS (≥ 1)")
    max_sequence_length: int | None = Field(None, description="Default: from the model config (≥ 2)")
    max_new_tokens: int = Field(1024, description="Server cap on max_new_tokens (≥ 1)")
    max_batch_size: int = Field(12, ge=1, description="Most requests in the running batch")
    max_concurrent_requests: int = Field(512, description="Permit pool, one permit per input (> 0)")
    max_waiting_tokens: int = Field(24, ge=1, description="Steps before a waiting request forces a prefill")
    max_prefill_padding: float = Field(0.2, description="Padded engines only, in [0.0, 1.0]")
    batch_safety_margin: int = Field(20, ge=0, le=100, description="Percent of memory kept free")
    estimate_memory: Literal["auto", "manual", "off"] = Field("auto", description="Memory model mode")
    estimate_memory_batch_size: int = Field(16, ge=1, description="Auto estimate: synthetic batch size")
    estimate_memory_min_samples: int = Field(5, ge=1, description="Auto estimate: points for the b, c fit")
    estimate_memory_start_seq_len: int = Field(100, ge=1, description="Auto estimate: shortest probe")
    estimate_memory_stop_seq_len: int = Field(1500, ge=1, description="Auto estimate: longest probe")
    estimate_memory_fit_threshold: float = Field(
        0.02, gt=0.0, description="Auto estimate: relative error that still counts as linear"
    )
    estimate_memory_new_tokens: int = Field(50, ge=1, description="Auto estimate: decode steps per sample")
    estimate_memory_new_token_samples: int = Field(
        2, ge=1, description="Auto estimate: input lengths of the decode samples"
    )
    cpu_memory_budget_mb: int | None = Field(
        None, ge=1, description="MiB batches may use on CPU; unset: no memory limit on CPU"
    )
    max_batch_weight: int | None = Field(None, description="Legacy; ignored with a warning")
    max_prefill_weight: int | None = Field(None, description="Legacy; ignored with a warning")
    port: int = Field(3000, ge=0, le=65535, description="HTTP health + metrics; 0 picks a free port")
    grpc_port: int = Field(8033, ge=0, le=65535, description="gRPC; 0 picks a free port")
    tls_cert_path: str | None = Field(None, description="PEM server certificate")
    tls_key_path: str | None = Field(None, description="PEM server key")
    tls_client_ca_cert_path: str | None = Field(None, description="PEM CA for client certs (mTLS)")
    api_key: str | None = Field(
        None,
        description="Generation on both doors requires `authorization: Bearer <API_KEY>` (HTTP header, "
        "gRPC metadata); /health, /metrics and gRPC health stay open",
    )
    http_generation_routes: bool = Field(
        True,
        description="Serve the OpenAI and TGI REST generation routes; false: HTTP serves /health and "
        "/metrics only, as TGIS's does",
    )
    http_generation_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the HTTP generation routes; default PORT, or 3001 when TLS is configured "
        "and HTTP_TLS is off (PORT then stays plaintext for probes and Prometheus)",
    )
    served_model_name: str | None = Field(
        None, description="The model id the HTTP APIs answer to; default MODEL_NAME (or `demo`)"
    )
    http_max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest HTTP request body")
    http_request_timeout: float = Field(
        600.0, ge=0, description="Seconds an HTTP request may take before a 408 (0: no limit)"
    )
    watermark_gamma: float = Field(
        0.5, gt=0, lt=1, description="TGI REST `watermark`: the share of the vocabulary on each green list"
    )
    watermark_delta: float = Field(
        2.0, ge=0, description="TGI REST `watermark`: the bias added to green-listed tokens' logits"
    )
    http_tls: bool = Field(
        False,
        description="Serve PORT (health, metrics) over TLS too; generation is over TLS whenever TLS is "
        "configured",
    )
    output_special_tokens: bool = Field(False, description="Render special tokens in output text")
    allow_runtime_lora_updating: bool = Field(
        False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter on the HTTP generation "
        "port, behind its guard (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); adapters loaded so serve on "
        "both doors by name",
    )
    generation_config: Literal["auto", "vllm"] = Field(
        "auto",
        description="auto: the OpenAI routes default temperature, top_p, top_k, min_p and "
        "repetition_penalty to the model's generation_config.json (as vLLM's --generation-config auto); "
        "vllm: to OpenAI's defaults. Its end-of-sequence ids stop generation either way",
    )
    add_special_tokens: bool = Field(
        True, description="Tokenize prompts with the tokenizer's special tokens (BOS); false: the text only"
    )
    disable_prompt_logprobs: bool = Field(
        False,
        description="Input token details carry the tokens only: no logprobs, ranks or top tokens, and no "
        "prompt logits computed for them",
    )
    default_include_stop_seqs: bool = Field(True, description="Default of include_stop_sequence")
    prefix_store_path: str | None = Field(
        None,
        validation_alias=AliasChoices("prefix_store_path", "adapter_cache"),
        description="Prompt-prefix / adapter store (env alias ADAPTER_CACHE)",
    )
    prompt_cache_size_mb: int = Field(512, ge=0, description="Prefix cache budget")
    # A non-integer is kept as given and rejected by `max_prefix_length` with TGIS's startup message.
    max_prompt_prefix_length: int | str | None = Field(None, description="Default ⌈L/2⌉")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint")
    flash_attention: bool = Field(
        False, description="Ask for the unpadded (paged) step; refused at start where the model cannot run it"
    )
    paged_attention: bool | None = Field(
        None,
        description="The flat, paged step with KV blocks: unset = wherever the model supports it, "
        "true = required (start fails otherwise), false = padded batches",
    )
    kv_cache_manager_num_gpu_blocks: int | None = Field(
        None, gt=0, description="Paged step: KV blocks in the pool; default sized from the memory"
    )
    kv_block_size: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Paged step: token positions per KV block; unset = 16, or on CUDA what the attention "
        "kernel reads in place (256 with PyTorch's FlashAttention 2 paged kernel)",
    )
    max_step_tokens: int = Field(
        256, ge=1, description="Paged step: tokens per forward (decode tokens + prompt chunks)"
    )
    prefix_caching: bool = Field(True, description="Paged step: reuse KV blocks of identical prompt prefixes")
    speculator_name: str | None = Field(
        None,
        description="Speculative decoding: `ngram` (prompt lookup), `demo` (the demo model's trained "
        "speculator), or a local dir or hub id of an MLP speculator (config model_type mlp_speculator)",
    )
    speculator_revision: str | None = Field(
        None, description="Revision of a hub-id SPECULATOR_NAME looked up in the HF cache (default main)"
    )
    speculator_n_candidates: int | None = Field(
        None, ge=1, description="Candidate token chains verified per sequence and step (1 here)"
    )
    speculator_top_k_tokens_per_head: str | None = Field(
        None,
        description="TGIS: top tokens per head that build the candidate chains; comma-separated, one per "
        "head. Only used with several candidates, so here it is checked and warned about",
    )
    speculator_max_batch_size: int = Field(
        16, ge=0, description="Speculate only while at most this many sequences decode"
    )
    speculator_tokens: int | None = Field(
        None,
        ge=1,
        le=16,
        description="Most tokens proposed per sequence and step; default the speculator's n_predict, "
        "8 for ngram",
    )
    pt2_compile: bool = Field(False, description="torch.compile the forward")
    cuda_graphs: bool = Field(
        True, description="CUDA, paged step: replay decode-only steps from graphs captured at startup"
    )
    cuda_process_memory_fraction: float = Field(1.0, description="GPU memory cap, in (0, 1]")
    allow_tf32: bool = Field(
        True, description="CUDA: float32 matmuls and convolutions may use TF32, as in TGIS (false: exact)"
    )
    tokenization_workers: int | None = Field(None, description="Default clamp(cpus − shards, 1, 8); > 0")
    json_output: bool = Field(False, description="Structured JSON logs")
    log_level: str = Field(
        "info",
        description="A level, or EnvFilter-style directives (`warn,tgis.requests=info`); a bad value "
        "logs at info with a warning",
    )
    otlp_endpoint: str | None = Field(None, description="OpenTelemetry collector")
    otel_service_name: str = Field(
        "text-generation-inference.router",
        validation_alias=AliasChoices("otel_service_name", "otlp_service_name"),
        description="Tracing service (TGIS's OTLP_SERVICE_NAME accepted as an alias)",
    )
    shard_uds_path: str | None = Field(
        None, description="TGIS's shard socket path; accepted, unused (shards talk over torch.distributed)"
    )
    master_addr: str = Field("localhost", description="torch.distributed rendezvous host")
    master_port: int = Field(29500, description="torch.distributed rendezvous port")
    transformers_attn_impl: str | None = Field(None, description="attn_implementation for transformers")
    shutdown_grace_seconds: float = Field(
        DEFAULT_SHUTDOWN_GRACE_SECONDS,
        ge=0.0,
        description="After SIGTERM, how long in-flight calls and streams may take to finish",
    )

    @field_validator("deployment_framework")
    @classmethod
    def _resolve_framework_alias(cls, value: str) -> str:
        return FRAMEWORK_ALIASES.get(value, value)

    @field_validator("model_name", "dtype", "dtype_str", "quantize", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("max_prompt_prefix_length", mode="before")
    @classmethod
    def _integer_string_is_int(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                return value
        return value

    @field_validator("pt2_compile", mode="before")
    @classmethod
    def _any_value_but_false(cls, value: Any) -> Any:
        """SPEC §7: PT2_COMPILE is on for any value but `false` (and `0` or empty)."""
        if isinstance(value, str):
            return value.strip().lower() not in ("false", "0", "")
        return value

    @field_validator("quantize_group_size")
    @classmethod
    def _kernel_group_size(cls, value: int) -> int:
        if value not in QUANTIZE_GROUP_SIZES:
            sizes = ", ".join(map(str, QUANTIZE_GROUP_SIZES))
            raise ValueError(f"must be one of {sizes} (what the int4 kernel takes)")
        return value

    @model_validator(mode="after")
    def _tgis_ranges(self) -> Settings:
        """The checks TGIS's launcher and router make, with their messages (`main.rs` of each)."""
        problem = tgis_range_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def paged_step(self) -> bool | None:
        """Whether to run the paged step: required (True), refused (False) or where supported (None).
        FLASH_ATTENTION asks for unpadded batches, which here is the paged step."""
        if self.paged_attention is not None:
            return self.paged_attention
        return True if self.flash_attention else None

    @property
    def dtype_name(self) -> str | None:
        return self.dtype or self.dtype_str

    def warn_legacy(self) -> None:
        for name in ("max_batch_weight", "max_prefill_weight"):
            value = getattr(self, name)
            if value is not None:
                logger.warning(f"{name.upper()} is set to {value} but this parameter will be ignored.")
        if self.shard_uds_path is not None:
            logger.warning(
                f"SHARD_UDS_PATH={self.shard_uds_path} is accepted but not used: there are no shard "
                "processes behind a router here; shards talk over torch.distributed"
            )


def tgis_range_problem(settings: Settings) -> str | None:
    """The first TGIS startup check the settings fail, in TGIS's words; None when all pass."""
    s = settings
    if not 0.0 < s.cuda_process_memory_fraction <= 1.0:
        return "cuda_process_memory_fraction must be in range 0 < x <= 1"
    if s.dtype and s.dtype_str and s.dtype != s.dtype_str:
        return "dtype and dtype_str args both provided with different values"
    if s.num_gpus is not None and s.num_shard is not None and s.num_gpus != s.num_shard:
        return f"NUM_GPUS and num_shard are set to different values ({s.num_gpus} and {s.num_shard})"
    if any(count is not None and count < 1 for count in (s.num_gpus, s.num_shard)):
        return "`num_shard` / NUM_GPUS cannot be < 1"
    if s.tokenization_workers is not None and s.tokenization_workers < 1:
        return "tokenization_workers must be > 0"
    if s.max_concurrent_requests < 1:
        return "max_concurrent_requests must be > 0"
    if not 0.0 <= s.max_prefill_padding <= 1.0:
        return f"max_prefill_padding ({s.max_prefill_padding}) must be a percentage in the range [0.0, 1.0]"
    if s.max_new_tokens < 1:
        return f"max_new_tokens ({s.max_new_tokens}) at least 1"
    if s.max_sequence_length is not None and s.max_sequence_length < 2:
        return f"max_sequence_length ({s.max_sequence_length}) must be at least 2 (1 input + 1 output)"
    return None


def shard_count(settings: Settings, environ: Mapping[str, str]) -> int:
    """SPEC §9.3: NUM_GPUS / NUM_SHARD, else the entries of CUDA_VISIBLE_DEVICES (else
    NVIDIA_VISIBLE_DEVICES), else 1. As in TGIS, an empty device list counts as one entry."""
    explicit = settings.num_gpus or settings.num_shard
    if explicit is not None:
        return explicit
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        devices = environ.get(name)
        if devices is not None:
            return len(devices.split(","))
    return 1


def model_max_sequence_length(model_config: dict[str, Any]) -> int:
    """The model's own sequence limit: the first integer among the known config keys (SPEC §9.2)."""
    for key in SEQUENCE_LENGTH_CONFIG_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return DEFAULT_MAX_SEQUENCE_LENGTH


@dataclass(frozen=True)
class ServingLimits:
    """The limits the server enforces and reports in ModelInfo."""

    max_sequence_length: int
    max_new_tokens: int


def effective_limits(settings: Settings, model_config: dict[str, Any]) -> ServingLimits:
    """Apply SPEC §9.2 to the settings and the model's config."""
    model_limit = model_max_sequence_length(model_config)
    max_seq = settings.max_sequence_length or model_limit
    if max_seq < 2:
        raise ValueError(f"max_sequence_length must be >= 2, the model config gives {max_seq}")
    if settings.max_sequence_length and settings.max_sequence_length > model_limit:
        logger.warning(f"MAX_SEQUENCE_LENGTH {max_seq} is above the model's limit of {model_limit}")
    max_new = settings.max_new_tokens
    if max_new >= max_seq:
        max_new = max_seq - 1
        logger.warning(f"MAX_NEW_TOKENS lowered to {max_new} to fit MAX_SEQUENCE_LENGTH {max_seq}")
    return ServingLimits(max_sequence_length=max_seq, max_new_tokens=max_new)


def max_prefix_length(settings: Settings, max_sequence_length: int) -> int:
    """SPEC §8: MAX_PROMPT_PREFIX_LENGTH, default ⌈L/2⌉; at most L − 1."""
    value = settings.max_prompt_prefix_length
    if value is None:
        return -(-max_sequence_length // 2)
    if isinstance(value, str) or value < 1:
        raise StartupError("Invalid value for MAX_PROMPT_PREFIX_LENGTH")
    if value > max_sequence_length - 1:
        raise StartupError(
            f"Value for the MAX_PROMPT_PREFIX_LENGTH ({value}) cannot be larger than the max sequence "
            f"length - 1 ({max_sequence_length - 1})"
        )
    return value
