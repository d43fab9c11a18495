"""Protobuf `Parameters` → effective parameters: "0 / unset means default" rules (SPEC §2.1)."""

from __future__ import annotations

import pytest

from tgis.pb import generation_pb2 as pb
from tgis.rpc.params import DEFAULT_MAX_NEW_TOKENS, constraint_of, effective_params
from tgis.types import (
    DecodingMethod,
    GenerationParams,
    LengthPenalty,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
)


def effective(message: pb.Parameters | None, *, default_include: bool = True) -> GenerationParams:
    return effective_params(message, default_include_stop_seqs=default_include)


# ---------------------------------------------------------------- no params / defaults


def test_absent_params_give_every_default() -> None:
    params = effective(None)
    assert params == GenerationParams()
    assert params.method == DecodingMethod.GREEDY
    assert params.is_greedy
    assert params.stopping.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 20
    assert params.stopping.include_stop_sequence is True
    assert params.repetition_penalty == 1.0
    assert params.length_penalty is None
    assert params.truncate_input_tokens == 0


def test_absent_params_use_server_default_for_include_stop_sequence() -> None:
    assert effective(None, default_include=False).stopping.include_stop_sequence is False


def test_empty_params_message_equals_absent_params() -> None:
    assert effective(pb.Parameters()) == effective(None)
    assert effective(pb.Parameters(), default_include=False) == effective(None, default_include=False)


# ---------------------------------------------------------------- step 1: truncate + response


def test_truncate_input_tokens_is_copied() -> None:
    assert effective(pb.Parameters(truncate_input_tokens=17)).truncate_input_tokens == 17


def test_all_six_response_flags_are_copied() -> None:
    message = pb.Parameters(
        response=pb.ResponseOptions(
            input_text=True,
            generated_tokens=True,
            input_tokens=True,
            token_logprobs=True,
            token_ranks=True,
            top_n_tokens=3,
        )
    )
    assert effective(message).response == ResponseOptions(
        input_text=True,
        generated_tokens=True,
        input_tokens=True,
        token_logprobs=True,
        token_ranks=True,
        top_n_tokens=3,
    )


# ---------------------------------------------------------------- step 2: decoding


def test_zero_repetition_penalty_means_one() -> None:
    message = pb.Parameters(decoding=pb.DecodingParameters(repetition_penalty=0.0))
    assert effective(message).repetition_penalty == 1.0


def test_nonzero_repetition_penalty_is_copied_even_if_invalid() -> None:
    def penalty(value: float) -> float:
        message = pb.Parameters(decoding=pb.DecodingParameters(repetition_penalty=value))
        return effective(message).repetition_penalty

    assert penalty(1.5) == 1.5
    # Negative values survive conversion so that validation can reject them (rule #7).
    assert penalty(-1.0) == -1.0


def test_present_length_penalty_is_copied() -> None:
    message = pb.Parameters(
        decoding=pb.DecodingParameters(
            length_penalty=pb.DecodingParameters.LengthPenalty(start_index=5, decay_factor=1.5)
        )
    )
    assert effective(message).length_penalty == LengthPenalty(start_index=5, decay_factor=1.5)


def test_present_but_empty_length_penalty_keeps_decay_zero() -> None:
    """Presence is tracked: an empty LengthPenalty is copied with decay 0 (so rule #8 rejects it)."""
    empty = pb.DecodingParameters.LengthPenalty()
    message = pb.Parameters(decoding=pb.DecodingParameters(length_penalty=empty))
    assert effective(message).length_penalty == LengthPenalty(start_index=0, decay_factor=0.0)


def test_absent_length_penalty_is_none() -> None:
    message = pb.Parameters(decoding=pb.DecodingParameters(repetition_penalty=1.2))
    assert effective(message).length_penalty is None


# ---------------------------------------------------------------- step 3: stopping


def test_zero_max_new_tokens_means_twenty() -> None:
    message = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=0))
    assert effective(message).stopping.max_new_tokens == 20


def test_stopping_fields_are_copied() -> None:
    message = pb.Parameters(
        stopping=pb.StoppingCriteria(
            max_new_tokens=50, min_new_tokens=7, time_limit_millis=1500, stop_sequences=["a", "bc"]
        )
    )
    assert effective(message).stopping == StoppingParams(
        max_new_tokens=50,
        min_new_tokens=7,
        time_limit_millis=1500,
        stop_sequences=("a", "bc"),
        include_stop_sequence=True,
    )


@pytest.mark.parametrize("server_default", [True, False])
def test_unset_include_stop_sequence_uses_server_default(server_default: bool) -> None:
    message = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=5))
    assert effective(message, default_include=server_default).stopping.include_stop_sequence is server_default


@pytest.mark.parametrize("server_default", [True, False])
@pytest.mark.parametrize("requested", [True, False])
def test_explicit_include_stop_sequence_overrides_server_default(
    server_default: bool, requested: bool
) -> None:
    message = pb.Parameters(stopping=pb.StoppingCriteria(include_stop_sequence=requested))
    assert effective(message, default_include=server_default).stopping.include_stop_sequence is requested


# ---------------------------------------------------------------- step 4: sampling


def test_sampling_fields_are_copied() -> None:
    message = pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.5, top_k=7, top_p=0.25, typical_p=0.75, seed=99),
    )
    params = effective(message)
    assert params.method == DecodingMethod.SAMPLE
    assert not params.is_greedy
    assert params.sampling == SamplingParams(temperature=0.5, top_k=7, top_p=0.25, typical_p=0.75, seed=99)


def test_unset_temperature_means_one_when_sampling() -> None:
    params = effective(pb.Parameters(method=pb.SAMPLE))
    assert params.sampling.temperature == 1.0
    assert not params.is_greedy


def test_explicit_zero_temperature_samples_greedily() -> None:
    params = effective(pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=0.0)))
    assert params.method == DecodingMethod.SAMPLE
    assert params.sampling.temperature == 0.0
    assert params.is_greedy


def test_zero_top_p_means_disabled() -> None:
    params = effective(pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(top_p=0.0)))
    assert params.sampling.top_p == 1.0


def test_zero_typical_p_and_top_k_mean_disabled() -> None:
    sampling = effective(pb.Parameters(method=pb.SAMPLE)).sampling
    assert sampling.top_k == 0
    assert sampling.typical_p == 0.0


def test_seed_presence_is_tracked() -> None:
    assert effective(pb.Parameters(method=pb.SAMPLE)).sampling.seed is None
    seeded = effective(pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(seed=0)))
    assert seeded.sampling.seed == 0
    big = effective(pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(seed=2**63 + 5)))
    assert big.sampling.seed == 2**63 + 5


def test_float_temperature_is_read_as_sent() -> None:
    params = effective(pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=0.7)))
    assert params.sampling.temperature == pytest.approx(0.7)


# ---------------------------------------------------------------- step 5: greedy ignores sampling


def test_greedy_ignores_sampling_entirely() -> None:
    message = pb.Parameters(
        method=pb.GREEDY,
        sampling=pb.SamplingParameters(temperature=0.01, top_k=2**31, top_p=5.0, typical_p=3.0, seed=1234),
    )
    params = effective(message)
    assert params.method == DecodingMethod.GREEDY
    assert params.sampling == SamplingParams()
    assert params.sampling.seed is None
    assert params.is_greedy


# ---------------------------------------------------------------- guided decoding


def test_no_guided_decoding_without_params_or_decoding() -> None:
    assert constraint_of(None) is None
    assert constraint_of(pb.Parameters()) is None
    assert constraint_of(pb.Parameters(decoding=pb.DecodingParameters(repetition_penalty=1.1))) is None


def test_text_response_format_is_no_constraint() -> None:
    message = pb.Parameters(decoding=pb.DecodingParameters(format=pb.DecodingParameters.TEXT))
    assert message.decoding.WhichOneof("guided") == "format"
    assert constraint_of(message) is None


@pytest.mark.parametrize(
    ("decoding", "kind"),
    [
        (pb.DecodingParameters(format=pb.DecodingParameters.JSON), "format"),
        (pb.DecodingParameters(json_schema='{"type": "object"}'), "json_schema"),
        (pb.DecodingParameters(regex="[a-z]+"), "regex"),
        (pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices(choices=["yes", "no"])), "choice"),
        (pb.DecodingParameters(grammar='root ::= "a"'), "grammar"),
    ],
)
def test_the_constraint_kind_names_the_oneof_field(decoding: pb.DecodingParameters, kind: str) -> None:
    constraint = constraint_of(pb.Parameters(decoding=decoding))
    assert constraint is not None and constraint.kind == kind


def test_last_guided_field_set_wins_the_oneof() -> None:
    decoding = pb.DecodingParameters(regex="a+")
    decoding.grammar = 'root ::= "b"'
    constraint = constraint_of(pb.Parameters(decoding=decoding))
    assert constraint is not None and constraint.kind == "grammar"
