"""Parameter and length validation in TGIS's order with its exact messages (SPEC §3.1); pure."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from tgis.engine_loop.tasks import Adapter, ValidatedInput
from tgis.errors import Msg, ValidationError
from tgis.sampling.config import SamplingConfig
from tgis.types import GenerationParams

MAX_STOP_SEQUENCES = 6
MAX_STOP_SEQUENCE_BYTES = 240
MAX_TOP_N_TOKENS = 10
INT32_MAX = 2**31 - 1


def validate_params(params: GenerationParams, *, max_new_tokens_limit: int) -> None:
    """Rules #1–#12 of SPEC §3.1 (first failure wins); sampling fields count only when sampling.

    Every float is checked to be finite where its rule stands: NaN fails no comparison, so without it
    a NaN would pass the rules and reach the sampler."""
    sampling, stopping, response = params.sampling, params.stopping, params.response
    # Greedy requests carry default sampling values (SPEC §2.1 #5), so these pass for them.
    _finite("temperature", sampling.temperature)
    if sampling.temperature != 0 and sampling.temperature < 0.05:
        raise ValidationError(Msg.TEMPERATURE)
    _finite("top_p", sampling.top_p)
    if sampling.top_p <= 0 or sampling.top_p > 1:
        raise ValidationError(Msg.TOP_P)
    _finite("typical_p", sampling.typical_p)
    if sampling.typical_p > 1:
        raise ValidationError(Msg.TYPICAL_P)
    if sampling.top_k > INT32_MAX:
        raise ValidationError(Msg.TOP_K)
    _finite("min_p", sampling.min_p)
    if not 0.0 <= sampling.min_p <= 1.0:
        raise ValidationError(Msg.MIN_P)
    if stopping.max_new_tokens > max_new_tokens_limit:
        raise ValidationError(Msg.MAX_NEW_TOKENS.format(max_new_tokens=max_new_tokens_limit))
    if stopping.min_new_tokens > stopping.max_new_tokens:
        raise ValidationError(Msg.MIN_GT_MAX)
    _finite("repetition_penalty", params.repetition_penalty)
    if params.repetition_penalty <= 0:
        raise ValidationError(Msg.REPETITION_PENALTY)
    if params.length_penalty is not None:
        _finite("length_penalty.decay_factor", params.length_penalty.decay_factor)
        if not 1.0 <= params.length_penalty.decay_factor <= 10.0:
            raise ValidationError(Msg.LENGTH_PENALTY)
    if len(stopping.stop_sequences) > MAX_STOP_SEQUENCES:
        raise ValidationError(Msg.STOP_SEQUENCES)
    wants_detail = response.token_logprobs or response.token_ranks or response.top_n_tokens != 0
    if wants_detail and not (response.input_tokens or response.generated_tokens):
        raise ValidationError(Msg.TOKEN_DETAIL)
    if any(not 0 < len(s.encode("utf-8")) <= MAX_STOP_SEQUENCE_BYTES for s in stopping.stop_sequences):
        raise ValidationError(Msg.STOP_SEQUENCES)
    if response.top_n_tokens > MAX_TOP_N_TOKENS:
        raise ValidationError(Msg.TOP_N.format(n=response.top_n_tokens))
    _check_http_extras(params)


def _check_http_extras(params: GenerationParams) -> None:
    """The parameters only the HTTP APIs set (OpenAI penalties and logit bias, TGI's watermark)."""
    _finite("presence_penalty", params.presence_penalty)
    _finite("frequency_penalty", params.frequency_penalty)
    for token_id, bias in params.logit_bias:
        _finite(f"logit_bias[{token_id}]", bias)
    if params.watermark is not None:
        _finite("watermark gamma", params.watermark[0])
        _finite("watermark delta", params.watermark[1])


def _finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValidationError(Msg.NOT_FINITE.format(name=name, value=value))


def validate_input(
    text: str,
    ids: Sequence[int],
    params: GenerationParams,
    *,
    adapter: Adapter | None = None,
    adapter_id: str | None = None,
    prefix_length: int,
    max_sequence_length: int,
    rng: random.Random,
    guide: object | None = None,
) -> ValidatedInput:
    """Rules #15–#16 for one tokenized (already truncated) input, then seed and clamp it."""
    length = len(ids)
    _check_length(length, prefix_length, params.stopping.min_new_tokens, max_sequence_length)
    max_new = params.stopping.max_new_tokens
    room = max_sequence_length - length - prefix_length
    seed = _seed(params, rng)
    return ValidatedInput(
        text=text,
        input_ids=tuple(ids),
        params=params,
        seed=seed,
        max_new_tokens=min(max_new, room),
        max_tokens_clamped=max_new > room,
        adapter=adapter,
        prefix_length=prefix_length,
        adapter_id=adapter_id if adapter is not None else None,
        guide=guide,
        sampling=sampling_config(params, seed, guide),
    )


def _check_length(length: int, prefix_length: int, min_new: int, max_sequence_length: int) -> None:
    """Rules #15–#16: at least one token, and room after the input (and its prefix) for a token and
    for min_new_tokens."""
    if length == 0:
        raise ValidationError(Msg.EMPTY_INPUT)
    if length + prefix_length >= max_sequence_length:
        raise ValidationError(
            Msg.INPUT_TOO_LONG.format(length=length, prefix=prefix_length, max=max_sequence_length)
        )
    if length + prefix_length + min_new > max_sequence_length:
        raise ValidationError(
            Msg.INPUT_PLUS_MIN_TOO_LONG.format(
                length=length, prefix=prefix_length, min=min_new, max=max_sequence_length
            )
        )


def sampling_config(params: GenerationParams, seed: int, guide: object | None) -> SamplingConfig:
    """The input's sampler settings; parameters the sampler cannot take fail here, as validation."""
    try:
        return SamplingConfig.from_params(params, seed, guide)
    except ValueError as exc:
        raise ValidationError(Msg.SAMPLING_INVALID.format(error=exc)) from exc


def _seed(params: GenerationParams, rng: random.Random) -> int:
    """Greedy → 0; sampling → the given seed, else a fresh random 32-bit one per input (SPEC §2.3)."""
    if params.is_greedy:
        return 0
    if params.sampling.seed is not None:
        return params.sampling.seed
    return rng.getrandbits(32)
