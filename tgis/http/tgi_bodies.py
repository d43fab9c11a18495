"""TGI's request bodies (GenerateParameters, with vLLM's min_p as an extension) and their mapping onto
GenerationParams; TGI's defaults: greedy unless sampling is asked for or implied by a warper."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tgis.errors import ValidationError
from tgis.guided import Constraint, json_schema_constraint
from tgis.http.defined_fields import TGI_PARAMETERS_REFUSED, refuse_unimplemented
from tgis.http.errors import RequestBody
from tgis.types import (
    DecodingMethod,
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
)

DEFAULT_MAX_NEW_TOKENS = 20  # TGI's default
MAX_BEST_OF = 4


class Parameters(RequestBody):
    """TGI's GenerateParameters, and vLLM's min_p as an extension."""

    do_sample: bool = False
    max_new_tokens: int | None = Field(None, ge=1)
    repetition_penalty: float | None = None
    return_full_text: bool = False
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, lt=2**63)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = Field(None, ge=0)
    typical_p: float | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)
    watermark: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = Field(None, ge=0)
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None
    min_p: float | None = None  # an extension: drop tokens below min_p × the top probability (sampling)
    bad_words: list[str] | None = None  # an extension, as vLLM's: words never generated


class GenerateRequest(RequestBody):
    inputs: str
    parameters: Parameters = Field(default_factory=Parameters)
    stream: bool = False

    @classmethod
    def refuse_unimplemented(cls, data: dict[str, Any]) -> None:
        parameters = data.get("parameters")
        if isinstance(parameters, dict):
            refuse_unimplemented(parameters, TGI_PARAMETERS_REFUSED, "parameters.")


class TokenizeRequest(RequestBody):
    inputs: str
    parameters: Parameters = Field(default_factory=Parameters)


def generation_params(
    p: Parameters, watermark: tuple[float, float], bad_words: tuple[tuple[int, ...], ...] = ()
) -> GenerationParams:
    """TGI parameters → GenerationParams; any warper set implies sampling, as in TGI. `watermark`:
    the (gamma, delta) a request's `watermark: true` applies; `bad_words`: the token sequences of the
    request's bad words."""
    sample = _samples(p)
    return GenerationParams(
        method=DecodingMethod.SAMPLE if sample else DecodingMethod.GREEDY,
        sampling=_sampling(p) if sample else SamplingParams(),
        stopping=StoppingParams(
            max_new_tokens=p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            stop_sequences=tuple(p.stop),
            include_stop_sequence=True,  # TGI keeps the stop sequence in the text
        ),
        # Token ids and logprobs fill `details`; best_of ranks candidates by their summed logprobs.
        response=ResponseOptions(
            generated_tokens=True,
            input_tokens=p.decoder_input_details,
            token_logprobs=True,
            top_n_tokens=p.top_n_tokens or 0,
        ),
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        truncate_input_tokens=p.truncate or 0,
        watermark=watermark if p.watermark else None,
        bad_words=bad_words,
    )


def _samples(p: Parameters) -> bool:
    """Whether the request samples: asked for, or implied by any warper; best_of > 1 needs sampling
    and no seed."""
    warpers = (
        bool(p.min_p)
        or (p.temperature is not None and p.temperature != 1.0)
        or bool(p.top_k)
        or (p.top_p is not None and p.top_p < 1.0)
        or bool(p.typical_p)
    )
    best_of = p.best_of or 1
    sample = p.do_sample or warpers
    if best_of > 1 and not sample:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if best_of > 1 and p.seed is not None:
        raise ValidationError("`seed` must not be set when `best_of` is > 1")
    return sample


def _sampling(p: Parameters) -> SamplingParams:
    """The warpers as TGI defaults them: temperature and top_p 1.0, top_k and typical_p off."""
    return SamplingParams(
        temperature=1.0 if p.temperature is None else p.temperature,
        top_k=p.top_k or 0,
        top_p=1.0 if p.top_p is None else p.top_p,
        typical_p=p.typical_p or 0.0,
        min_p=p.min_p or 0.0,
        seed=p.seed,
    )


def grammar_constraint(grammar: dict[str, Any] | None) -> Constraint | None:
    """TGI's `grammar` ({"type": "json" | "regex", "value": ...}) as a guided-decoding constraint."""
    if grammar is None:
        return None
    kind, value = grammar.get("type"), grammar.get("value")
    if kind == "json" and isinstance(value, dict | str):
        return json_schema_constraint(value)
    if kind == "regex" and isinstance(value, str):
        return Constraint("regex", value)
    raise ValidationError(
        'grammar must be {"type": "json", "value": <schema>} or {"type": "regex", "value": <str>}'
    )
