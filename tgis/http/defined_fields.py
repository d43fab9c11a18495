"""Which request fields each HTTP API defines, and which of those tgis refuses.

A field an API defines that tgis does not implement is a 400 naming it, never silently dropped; a field
nobody defines is ignored, as OpenAI ignores it. A refused field given as null, or as the value that
means "nothing" (`store: false`, `length_penalty: 1.0`), asks for nothing and passes.

Sources, checked by tests/unit/http/test_defined_fields.py against the request models:
- OpenAI: openai-python 3.63, `openai.types.chat.completion_create_params.CompletionCreateParamsBase`
  and `openai.types.completion_create_params.CompletionCreateParamsBase` (plus `stream`).
- vLLM's extras on the same routes: vllm/entrypoints/openai/protocol.py, `ChatCompletionRequest` and
  `CompletionRequest` (the sampling-params and extra-params blocks).
- TGI: text-generation-inference router/src/lib.rs, `GenerateParameters` (and `adapter_id`, added in
  2.1), `GenerateRequest` / `CompatGenerateRequest`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tgis.errors import ValidationError

OPENAI_CHAT = frozenset(
    {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
        "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n",
        "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
        "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
        "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
        "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
    }
)  # fmt: skip
OPENAI_COMPLETIONS = frozenset(
    {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
        "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
        "top_p", "user",
    }
)  # fmt: skip
_VLLM_SAMPLING = frozenset(
    {
        "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
        "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
        # older vLLM releases
        "early_stopping", "bad_words",
    }
)  # fmt: skip
_VLLM_EXTRA = frozenset(
    {
        "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
        "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
        "logits_processors", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    }
)  # fmt: skip
_VLLM_CHAT_ONLY = frozenset(
    {
        "best_of", "echo", "add_generation_prompt", "continue_final_message", "documents",
        "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
        "include_reasoning",
    }
)  # fmt: skip
VLLM_CHAT = _VLLM_SAMPLING | _VLLM_EXTRA | _VLLM_CHAT_ONLY
VLLM_COMPLETIONS = _VLLM_SAMPLING | _VLLM_EXTRA | frozenset({"prompt_embeds"})
TGI_PARAMETERS = frozenset(
    {
        "best_of", "temperature", "repetition_penalty", "frequency_penalty", "top_k", "top_p", "typical_p",
        "do_sample", "max_new_tokens", "return_full_text", "stop", "truncate", "watermark", "details",
        "decoder_input_details", "seed", "top_n_tokens", "grammar", "adapter_id",
    }
)  # fmt: skip
TGI_REQUEST = frozenset({"inputs", "parameters", "stream"})

_ANY: tuple[Any, ...] = ()  # no value but null asks for nothing

# Defined and not implemented, with the values that ask for nothing.
_VLLM_REFUSED: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (0,),
    "allowed_token_ids": _ANY,
    "guided_decoding_backend": ("xgrammar", "auto"),
    "guided_whitespace_pattern": _ANY,
    "priority": (0,),
    "request_id": _ANY,
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "cache_salt": _ANY,
    "kv_transfer_params": _ANY,
    "vllm_xargs": ({},),
}
OPENAI_CHAT_REFUSED: dict[str, tuple[Any, ...]] = {
    "audio": _ANY,
    "function_call": ("none",),
    "functions": ([],),
    "metadata": ({},),
    "modalities": (["text"],),
    "moderation": _ANY,
    "prediction": _ANY,
    "prompt_cache_key": _ANY,
    "prompt_cache_options": _ANY,
    "prompt_cache_retention": _ANY,
    "reasoning_effort": _ANY,
    "service_tier": ("auto", "default"),
    "store": (False,),
    "verbosity": _ANY,
    "web_search_options": _ANY,
    **_VLLM_REFUSED,
    "best_of": (1,),
    "echo": (False,),
    "add_special_tokens": (False,),
    "continue_final_message": (False,),
    "documents": ([],),
    "chat_template": _ANY,
    "mm_processor_kwargs": ({},),
    "structural_tag": _ANY,
    "include_reasoning": (True,),
}
OPENAI_COMPLETIONS_REFUSED: dict[str, tuple[Any, ...]] = {
    **_VLLM_REFUSED,
    "suffix": ("",),
    "add_special_tokens": (True,),
    "prompt_embeds": _ANY,
}
TGI_PARAMETERS_REFUSED: dict[str, tuple[Any, ...]] = {"frequency_penalty": (0, 0.0)}


def refuse_unimplemented(
    data: Mapping[str, Any], refused: Mapping[str, tuple[Any, ...]], where: str = ""
) -> None:
    """A 400 naming the first field of `data` that is defined, not implemented, and asks for something."""
    for name, value in data.items():
        accepted = refused.get(name)
        if accepted is None or value is None or _same(value, accepted):
            continue
        raise ValidationError(f"{where}{name} is not supported by this server")


def _same(value: Any, accepted: tuple[Any, ...]) -> bool:
    # bool is an int in Python: `True == 1` must not let `priority: true` or `best_of: true` through.
    return any(type(value) is type(a) and value == a for a in accepted) or any(
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and isinstance(a, int | float)
        and not isinstance(a, bool)
        and value == a
        for a in accepted
    )
