"""Typed errors and TGIS's exact client-visible messages; gRPC codes are attached in server/ only."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Names match `grpc.StatusCode` members; the servicer maps them in one place."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNKNOWN = "UNKNOWN"
    UNAVAILABLE = "UNAVAILABLE"


class Msg(enum.StrEnum):
    """Client-visible message templates (SPEC §3); format with str.format."""

    TEMPERATURE = "temperature must be >= 0.05"
    TOP_P = "top_p must be > 0.0 and <= 1.0"
    TYPICAL_P = "typical_p must be <= 1.0"
    TOP_K = "top_k must be strictly positive"
    MAX_NEW_TOKENS = "max_new_tokens must be <= {max_new_tokens}"
    MIN_GT_MAX = "min_new_tokens must be <= max_new_tokens"
    REPETITION_PENALTY = "repetition_penalty must be > 0.0"
    LENGTH_PENALTY = "length_penalty must be >= 1.0 and <= 10.0"
    STOP_SEQUENCES = "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes"
    TOKEN_DETAIL = "must request input and/or generated tokens to request extra token detail"
    TOP_N = "top_n_tokens ({n}) must be <= 10"
    # Project additions in the same style: vLLM's extras on the HTTP APIs.
    MIN_P = "min_p must be >= 0.0 and <= 1.0"
    STOP_TOKEN_IDS = "stop_token_ids must be in [0, {vocab}), got {token_id}"
    PREFIX_LOOKUP = "can't retrieve prompt prefix with id '{id}': {reason}"
    TOKENIZER = "tokenizer error {error}"
    INPUT_TOO_LONG = "input tokens ({length}) plus prefix length ({prefix}) must be < {max}"
    INPUT_PLUS_MIN_TOO_LONG = (
        "input tokens ({length}) plus prefix length ({prefix}) plus min_new_tokens ({min}) must be <= {max}"
    )
    EMPTY_INPUT = "input must contain at least one token"
    # Project addition: NaN and ±inf pass every comparison-based rule above, so they are refused first.
    NOT_FINITE = "{name} must be a finite number, got {value}"
    SAMPLING_INVALID = "invalid sampling parameters: {error}"
    # Guided decoding (DecodingParameters.guided): {field} is the proto field name.
    GUIDED_CHOICES = "Must provide at least two choices"
    GUIDED_INVALID = "invalid guided decoding {field}: {error}"
    GUIDED_TIMEOUT = "guided decoding {field} did not compile within {seconds:g} s"
    ADAPTER_STORE_MISSING = "adapter_id supplied but no adapter store was configured"
    # Adapter store load failures: the {reason} of PREFIX_LOOKUP (SPEC §8).
    PREFIX_ID_CHARS = "Invalid prefix id {id}, must contain only alphanumeric, _ and - and /"
    PREFIX_ID_INVALID = "Invalid prefix id {id}"
    PREFIX_NOT_FOUND = 'prefix id "{id}" not found'
    PREFIX_TENSOR_INVALID = "Invalid prefix embedding tensor"
    PREFIX_LENGTH_INVALID = "Invalid prefix embedding length of {length}"
    PREFIX_ODD_LENGTH = "Encoder/decoder prefix tensor must be of even length"
    PREFIX_DIM_MISMATCH = "Prefix embedding tensor dim {dim} does not match model ({expected})"
    PREFIX_NON_FINITE = "Prefix contains non-finite elements"
    PREFIX_NON_FINITE_AFTER_CAST = "Prefix contains non-finite elements after conversion from {src} to {dst}"
    PREFIX_TOO_LARGE = "Prefix ID object {id} exceeds the allowed cache size"
    PEFT_ENCODER_DECODER = "encoder-decoder architectures not supported for peft models"
    ADAPTER_TYPE_UNSUPPORTED = "adapter type {type} is not currently supported"
    # Project additions: TGIS let these surface as raw exception texts.
    ADAPTER_CONFIG_INVALID = "Invalid adapter config: {error}"
    ADAPTER_FILE_UNREADABLE = "Could not read {file}: {error}"
    LORA_INVALID = "Invalid LoRA adapter: {detail}"
    LORA_UNSUPPORTED_BY_ENGINE = "LoRA adapters are not supported by the {engine} engine"
    LORA_UNSUPPORTED_COMPILED = "LoRA adapters are not supported with PT2_COMPILE"
    PREFIX_UNSUPPORTED_BY_ENGINE = "prompt prefixes are not supported by the {engine} engine"
    OVERLOADED = "Model is overloaded"
    QUEUE_FULL = "Server too busy"
    MISSING_REQUEST = "missing request"
    GENERATION_FAILED = "Request failed during generation: {detail}"
    DETOKENIZATION_FAILED = "Request failed during detokenization: {detail}"
    # Known {detail} values of the two messages above (SPEC §3.2).
    GPU_OUT_OF_MEMORY = "GPU out of memory"
    ERROR_AFTER_TOKENS = "Error after generating {count} tokens: {error}"
    TOKEN_DECODING = "Token decoding error: {error}"
    PREFIX_RETRIEVAL = "Error retrieving prompt prefix '{id}'"
    SHUTTING_DOWN = "Server is shutting down"


class TgisError(Exception):
    """An error with a client-visible message and the gRPC status it maps to."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str) -> None:
        # Plain str: grpc rejects str subclasses such as Msg members as status details.
        self.message = str(message)
        super().__init__(self.message)


class ValidationError(TgisError):
    code = ErrorCode.INVALID_ARGUMENT


class OverloadedError(TgisError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class GenerationError(TgisError):
    code = ErrorCode.UNKNOWN


class ShuttingDownError(TgisError):
    code = ErrorCode.UNAVAILABLE


class StartupError(Exception):
    """An operator error found at startup; reported as one clear line, without a traceback."""
