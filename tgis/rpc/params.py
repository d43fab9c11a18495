"""Protobuf `Parameters` → effective GenerationParams, applying TGIS's "0 means default" rules (SPEC §2.1)."""

from __future__ import annotations

from tgis.guided import ANY_JSON_OBJECT_SCHEMA, Constraint, choice_constraint
from tgis.pb import generation_pb2 as pb
from tgis.types import (
    DecodingMethod,
    GenerationParams,
    LengthPenalty,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
)

DEFAULT_MAX_NEW_TOKENS = 20


def effective_params(message: pb.Parameters | None, *, default_include_stop_seqs: bool) -> GenerationParams:
    """Apply SPEC §2.1 to a request's `params`; an absent message means every default."""
    if message is None:
        return GenerationParams(stopping=StoppingParams(include_stop_sequence=default_include_stop_seqs))
    method = DecodingMethod(message.method)
    decoding = message.decoding
    length_penalty = None
    if decoding.HasField("length_penalty"):
        length_penalty = LengthPenalty(
            start_index=decoding.length_penalty.start_index,
            decay_factor=decoding.length_penalty.decay_factor,
        )
    return GenerationParams(
        method=method,
        sampling=_sampling(message.sampling) if method == DecodingMethod.SAMPLE else SamplingParams(),
        stopping=_stopping(message.stopping, default_include_stop_seqs),
        response=_response(message.response),
        repetition_penalty=decoding.repetition_penalty or 1.0,
        length_penalty=length_penalty,
        truncate_input_tokens=message.truncate_input_tokens,
    )


def _sampling(message: pb.SamplingParameters) -> SamplingParams:
    # Unset temperature means 1.0; an explicit 0.0 (only new clients can send one) means greedy.
    temperature = message.temperature if message.HasField("temperature") else 1.0
    return SamplingParams(
        temperature=temperature,
        top_k=message.top_k,
        top_p=message.top_p or 1.0,
        typical_p=message.typical_p,
        seed=message.seed if message.HasField("seed") else None,
    )


def _stopping(message: pb.StoppingCriteria, default_include: bool) -> StoppingParams:
    include = message.include_stop_sequence if message.HasField("include_stop_sequence") else default_include
    return StoppingParams(
        max_new_tokens=message.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        min_new_tokens=message.min_new_tokens,
        time_limit_millis=message.time_limit_millis,
        stop_sequences=tuple(message.stop_sequences),
        include_stop_sequence=include,
    )


def _response(message: pb.ResponseOptions) -> ResponseOptions:
    return ResponseOptions(
        input_text=message.input_text,
        generated_tokens=message.generated_tokens,
        input_tokens=message.input_tokens,
        token_logprobs=message.token_logprobs,
        token_ranks=message.token_ranks,
        top_n_tokens=message.top_n_tokens,
    )


def constraint_of(message: pb.Parameters | None) -> Constraint | None:
    """The request's constraint, or None (no `guided` field, or `format = TEXT`); checks `choice`."""
    if message is None or not message.HasField("decoding"):
        return None
    decoding = message.decoding
    kind = decoding.WhichOneof("guided")
    if kind is None or (kind == "format" and decoding.format == pb.DecodingParameters.TEXT):
        return None
    if kind == "format":
        return Constraint("format", ANY_JSON_OBJECT_SCHEMA)
    if kind == "choice":
        return choice_constraint(list(decoding.choice.choices))
    return Constraint(kind, getattr(decoding, kind))
