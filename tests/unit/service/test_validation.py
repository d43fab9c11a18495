"""Parameter and length validation: TGIS order and exact messages, seeding, clamping (SPEC §3.1, §3.3)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from tgis.errors import Msg, ValidationError
from tgis.pb import generation_pb2 as pb
from tgis.rpc.params import effective_params
from tgis.service.validation import ValidatedInput, validate_input, validate_params
from tgis.types import DecodingMethod, GenerationParams, SamplingParams

# SPEC §3.3 boundary settings.
MAX_SEQ = 200
MAX_NEW = 169

STOP_MSG = "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes"
DETAIL_MSG = "must request input and/or generated tokens to request extra token detail"


def params_of(
    *,
    method: Any = pb.GREEDY,
    sampling: pb.SamplingParameters | None = None,
    stopping: pb.StoppingCriteria | None = None,
    response: pb.ResponseOptions | None = None,
    decoding: pb.DecodingParameters | None = None,
) -> GenerationParams:
    message = pb.Parameters(
        method=method, sampling=sampling, stopping=stopping, response=response, decoding=decoding
    )
    return effective_params(message, default_include_stop_seqs=True)


def sample(**fields: Any) -> GenerationParams:
    return params_of(method=pb.SAMPLE, sampling=pb.SamplingParameters(**fields))


def error_of(params: GenerationParams, *, limit: int = MAX_NEW) -> str:
    with pytest.raises(ValidationError) as caught:
        validate_params(params, max_new_tokens_limit=limit)
    return caught.value.message


def passes(params: GenerationParams, *, limit: int = MAX_NEW) -> None:
    validate_params(params, max_new_tokens_limit=limit)


def accept(
    length: int,
    params: GenerationParams,
    *,
    prefix: int = 0,
    max_seq: int = MAX_SEQ,
    rng: random.Random | None = None,
) -> ValidatedInput:
    return validate_input(
        "text",
        list(range(5, 5 + length)),
        params,
        prefix_length=prefix,
        max_sequence_length=max_seq,
        rng=rng or random.Random(0),
    )


def input_error(length: int, params: GenerationParams, *, prefix: int = 0, max_seq: int = MAX_SEQ) -> str:
    with pytest.raises(ValidationError) as caught:
        accept(length, params, prefix=prefix, max_seq=max_seq)
    return caught.value.message


def test_validation_error_is_invalid_argument() -> None:
    with pytest.raises(ValidationError) as caught:
        validate_params(sample(temperature=0.01), max_new_tokens_limit=MAX_NEW)
    assert caught.value.code.value == "INVALID_ARGUMENT"
    assert str(caught.value) == caught.value.message


def test_default_params_pass() -> None:
    passes(GenerationParams())
    passes(params_of())
    passes(sample())


# ---------------------------------------------------------------- rule 1: temperature


@pytest.mark.parametrize("temperature", [0.01, 0.049, -0.5, -2.0])
def test_temperature_below_minimum_fails(temperature: float) -> None:
    assert error_of(sample(temperature=temperature)) == "temperature must be >= 0.05"


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 2.0, 100.0])
def test_temperature_at_or_above_minimum_passes(temperature: float) -> None:
    passes(sample(temperature=temperature))


def test_explicit_zero_temperature_passes_and_means_greedy() -> None:
    params = sample(temperature=0.0)
    passes(params)
    assert params.is_greedy


# ---------------------------------------------------------------- rule 2: top_p


@pytest.mark.parametrize("top_p", [-0.1, 1.01, 5.0])
def test_top_p_out_of_range_fails(top_p: float) -> None:
    assert error_of(sample(top_p=top_p)) == "top_p must be > 0.0 and <= 1.0"


@pytest.mark.parametrize("top_p", [0.0, 0.001, 0.5, 1.0])
def test_top_p_in_range_or_unset_passes(top_p: float) -> None:
    passes(sample(top_p=top_p))


def test_top_p_zero_in_effective_params_fails() -> None:
    """`top_p <= 0` in the *effective* params (only reachable without the 0 → 1.0 conversion)."""
    params = GenerationParams(method=DecodingMethod.SAMPLE, sampling=SamplingParams(top_p=0.0))
    assert error_of(params) == "top_p must be > 0.0 and <= 1.0"


# ---------------------------------------------------------------- rule 3: typical_p


def test_typical_p_above_one_fails() -> None:
    assert error_of(sample(typical_p=1.5)) == "typical_p must be <= 1.0"


@pytest.mark.parametrize("typical_p", [-0.5, -100.0, 0.0, 0.3, 1.0])
def test_typical_p_up_to_one_passes_including_negative(typical_p: float) -> None:
    passes(sample(typical_p=typical_p))


# ---------------------------------------------------------------- rule 4: top_k


@pytest.mark.parametrize("top_k", [2**31, 2**31 + 1, 2**32 - 1])
def test_top_k_read_as_negative_int32_fails(top_k: int) -> None:
    assert error_of(sample(top_k=top_k)) == "top_k must be strictly positive"


@pytest.mark.parametrize("top_k", [0, 1, 50, 2**31 - 1])
def test_top_k_within_int32_passes(top_k: int) -> None:
    passes(sample(top_k=top_k))


# ---------------------------------------------------------------- greedy ignores sampling


def test_greedy_mode_ignores_every_bad_sampling_field() -> None:
    params = params_of(
        method=pb.GREEDY,
        sampling=pb.SamplingParameters(temperature=0.01, top_p=7.0, typical_p=3.0, top_k=2**31, seed=5),
    )
    passes(params)
    assert accept(10, params).seed == 0


# ---------------------------------------------------------------- rule 5: max_new_tokens


def test_max_new_tokens_above_server_limit_fails() -> None:
    params = params_of(stopping=pb.StoppingCriteria(max_new_tokens=170))
    assert error_of(params) == "max_new_tokens must be <= 169"


def test_max_new_tokens_at_server_limit_passes() -> None:
    passes(params_of(stopping=pb.StoppingCriteria(max_new_tokens=169)))


def test_unset_max_new_tokens_fails_when_server_limit_below_twenty() -> None:
    """SPEC §9.2 quirk: the default of 20 is itself checked against the server cap."""
    assert error_of(params_of(), limit=10) == "max_new_tokens must be <= 10"
    passes(params_of(), limit=20)


# ---------------------------------------------------------------- rule 6: min vs max


def test_min_new_tokens_above_max_new_tokens_fails() -> None:
    params = params_of(stopping=pb.StoppingCriteria(min_new_tokens=20, max_new_tokens=10))
    assert error_of(params) == "min_new_tokens must be <= max_new_tokens"


def test_min_new_tokens_is_compared_with_default_max_of_twenty() -> None:
    assert error_of(params_of(stopping=pb.StoppingCriteria(min_new_tokens=21))) == (
        "min_new_tokens must be <= max_new_tokens"
    )
    passes(params_of(stopping=pb.StoppingCriteria(min_new_tokens=20)))


def test_min_equal_to_max_passes() -> None:
    passes(params_of(stopping=pb.StoppingCriteria(min_new_tokens=15, max_new_tokens=15)))


# ---------------------------------------------------------------- rule 7: repetition_penalty


@pytest.mark.parametrize("penalty", [-0.1, -2.0])
def test_non_positive_repetition_penalty_fails(penalty: float) -> None:
    params = params_of(decoding=pb.DecodingParameters(repetition_penalty=penalty))
    assert error_of(params) == "repetition_penalty must be > 0.0"


def test_zero_repetition_penalty_in_effective_params_fails() -> None:
    assert error_of(GenerationParams(repetition_penalty=0.0)) == "repetition_penalty must be > 0.0"


@pytest.mark.parametrize("penalty", [0.0, 0.01, 1.0, 2.5, 50.0])
def test_positive_or_unset_repetition_penalty_passes(penalty: float) -> None:
    """No upper bound: the adapter's `<= 2.0` rule is not used."""
    passes(params_of(decoding=pb.DecodingParameters(repetition_penalty=penalty)))


# ---------------------------------------------------------------- rule 8: length_penalty


def length_penalty(decay: float, start: int = 0) -> GenerationParams:
    lp = pb.DecodingParameters.LengthPenalty(start_index=start, decay_factor=decay)
    return params_of(decoding=pb.DecodingParameters(length_penalty=lp))


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.99, 10.01, 11.0, -1.0])
def test_length_penalty_decay_outside_one_to_ten_fails(decay: float) -> None:
    assert error_of(length_penalty(decay)) == "length_penalty must be >= 1.0 and <= 10.0"


def test_length_penalty_with_decay_left_at_zero_fails() -> None:
    params = params_of(
        decoding=pb.DecodingParameters(length_penalty=pb.DecodingParameters.LengthPenalty(start_index=4))
    )
    assert error_of(params) == "length_penalty must be >= 1.0 and <= 10.0"


@pytest.mark.parametrize("decay", [1.0, 1.5, 10.0])
def test_length_penalty_decay_within_bounds_passes(decay: float) -> None:
    passes(length_penalty(decay, start=3))


# ---------------------------------------------------------------- rule 9 / 11: stop sequences


def stops(*sequences: str) -> GenerationParams:
    return params_of(stopping=pb.StoppingCriteria(stop_sequences=list(sequences)))


def test_more_than_six_stop_sequences_fails() -> None:
    assert error_of(stops(*"abcdefg")) == STOP_MSG


def test_six_stop_sequences_pass() -> None:
    passes(stops(*"abcdef"))


def test_empty_stop_sequence_fails() -> None:
    assert error_of(stops("empty not allowed", "")) == STOP_MSG


def test_stop_sequence_over_240_utf8_bytes_fails() -> None:
    assert error_of(stops("x" * 241)) == STOP_MSG
    # 121 characters but 242 bytes: the limit is in UTF-8 bytes, not characters.
    assert error_of(stops("é" * 121)) == STOP_MSG


def test_stop_sequence_of_exactly_240_utf8_bytes_passes() -> None:
    passes(stops("x" * 240))
    passes(stops("☃" * 80))


# ---------------------------------------------------------------- rule 10: token detail


@pytest.mark.parametrize(
    "response",
    [
        pb.ResponseOptions(token_logprobs=True),
        pb.ResponseOptions(token_ranks=True),
        pb.ResponseOptions(top_n_tokens=2),
        pb.ResponseOptions(token_logprobs=True, input_text=True),
    ],
)
def test_token_detail_without_tokens_fails(response: pb.ResponseOptions) -> None:
    assert error_of(params_of(response=response)) == DETAIL_MSG


@pytest.mark.parametrize(
    "response",
    [
        pb.ResponseOptions(token_logprobs=True, token_ranks=True, top_n_tokens=3, generated_tokens=True),
        pb.ResponseOptions(token_logprobs=True, token_ranks=True, top_n_tokens=3, input_tokens=True),
        pb.ResponseOptions(generated_tokens=True, input_tokens=True, input_text=True),
    ],
)
def test_token_detail_with_tokens_passes(response: pb.ResponseOptions) -> None:
    passes(params_of(response=response))


# ---------------------------------------------------------------- rule 12: top_n limit


def test_top_n_above_ten_fails() -> None:
    params = params_of(response=pb.ResponseOptions(generated_tokens=True, top_n_tokens=11))
    assert error_of(params) == "top_n_tokens (11) must be <= 10"


def test_top_n_of_ten_passes() -> None:
    passes(params_of(response=pb.ResponseOptions(generated_tokens=True, top_n_tokens=10)))


# ---------------------------------------------------------------- non-finite numbers (project addition)

NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("temperature", lambda v: sample(temperature=v)),
        ("top_p", lambda v: sample(top_p=v)),
        ("typical_p", lambda v: sample(typical_p=v)),
        ("repetition_penalty", lambda v: params_of(decoding=pb.DecodingParameters(repetition_penalty=v))),
        (
            "length_penalty.decay_factor",
            lambda v: params_of(
                decoding=pb.DecodingParameters(
                    length_penalty=pb.DecodingParameters.LengthPenalty(decay_factor=v)
                )
            ),
        ),
        ("presence_penalty", lambda v: GenerationParams(presence_penalty=v)),
        ("frequency_penalty", lambda v: GenerationParams(frequency_penalty=v)),
        ("logit_bias[7]", lambda v: GenerationParams(logit_bias=((7, v),))),
        ("watermark delta", lambda v: GenerationParams(watermark=(0.5, v))),
    ],
)
def test_non_finite_floats_fail_naming_the_parameter(name: str, build: Any, value: float) -> None:
    assert error_of(build(value)) == f"{name} must be a finite number, got {value}"


def test_non_finite_sampling_fields_pass_in_greedy_mode() -> None:
    """SPEC §2.1 #5: greedy ignores `sampling` entirely, NaN included."""
    nan = math.nan
    passes(
        params_of(method=pb.GREEDY, sampling=pb.SamplingParameters(temperature=nan, top_p=nan, typical_p=nan))
    )


def test_odd_but_finite_floats_meet_the_ordinary_rules() -> None:
    """-0.0 is not > 0; a denormal and 1e308 are positive numbers like any other."""
    assert error_of(GenerationParams(repetition_penalty=-0.0)) == "repetition_penalty must be > 0.0"
    passes(GenerationParams(repetition_penalty=5e-324))
    passes(GenerationParams(repetition_penalty=1e308))


def test_odd_floats_on_the_wire_follow_float32_and_zero_means_unset() -> None:
    """Parameters are float32 on the wire: -0.0 reads as unset (1.0), 1e308 arrives as inf."""
    passes(params_of(decoding=pb.DecodingParameters(repetition_penalty=-0.0)))
    assert params_of(decoding=pb.DecodingParameters(repetition_penalty=-0.0)).repetition_penalty == 1.0
    huge = params_of(decoding=pb.DecodingParameters(repetition_penalty=1e308))
    assert error_of(huge) == "repetition_penalty must be a finite number, got inf"


def test_validated_inputs_carry_a_sampling_config_the_sampler_can_take() -> None:
    validated = accept(5, sample(temperature=0.7, top_k=3, seed=11))
    assert validated.sampling.temperature == pytest.approx(0.7)
    assert validated.sampling.top_k == 3 and validated.sampling.seed == 11 and not validated.sampling.greedy


def test_a_config_the_sampler_refuses_fails_validation_not_the_engine() -> None:
    """A value no TGIS rule covers (a negative top_k from the TGI API) is refused at validation."""
    with pytest.raises(ValidationError) as caught:
        accept(5, GenerationParams(method=DecodingMethod.SAMPLE, sampling=SamplingParams(top_k=-5)))
    assert caught.value.message == "invalid sampling parameters: invalid SamplingConfig: top_k must be >= 0"


# ---------------------------------------------------------------- order: first failure wins


ORDERED_CASES = [
    # (rules violated, params, expected message)
    ("1+2", sample(temperature=0.01, top_p=2.0), "temperature must be >= 0.05"),
    ("2+3", sample(top_p=2.0, typical_p=2.0), "top_p must be > 0.0 and <= 1.0"),
    ("3+4", sample(typical_p=2.0, top_k=2**31), "typical_p must be <= 1.0"),
    (
        "4+5",
        params_of(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(top_k=2**31),
            stopping=pb.StoppingCriteria(max_new_tokens=500),
        ),
        "top_k must be strictly positive",
    ),
    (
        "2+5",
        params_of(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(top_p=2.0),
            stopping=pb.StoppingCriteria(max_new_tokens=500),
        ),
        "top_p must be > 0.0 and <= 1.0",
    ),
    (
        "5+6",
        params_of(stopping=pb.StoppingCriteria(max_new_tokens=500, min_new_tokens=600)),
        "max_new_tokens must be <= 169",
    ),
    (
        "6+7",
        params_of(
            stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=6),
            decoding=pb.DecodingParameters(repetition_penalty=-1.0),
        ),
        "min_new_tokens must be <= max_new_tokens",
    ),
    (
        "7+8",
        params_of(
            decoding=pb.DecodingParameters(
                repetition_penalty=-1.0, length_penalty=pb.DecodingParameters.LengthPenalty()
            )
        ),
        "repetition_penalty must be > 0.0",
    ),
    (
        "8+9",
        params_of(
            decoding=pb.DecodingParameters(length_penalty=pb.DecodingParameters.LengthPenalty()),
            stopping=pb.StoppingCriteria(stop_sequences=list("abcdefg")),
        ),
        "length_penalty must be >= 1.0 and <= 10.0",
    ),
    (
        "9+10",
        params_of(
            stopping=pb.StoppingCriteria(stop_sequences=list("abcdefg")),
            response=pb.ResponseOptions(token_logprobs=True),
        ),
        STOP_MSG,
    ),
    (
        "10+11",
        params_of(
            stopping=pb.StoppingCriteria(stop_sequences=["ok", ""]),
            response=pb.ResponseOptions(token_logprobs=True),
        ),
        DETAIL_MSG,
    ),
    ("10+12", params_of(response=pb.ResponseOptions(top_n_tokens=11)), DETAIL_MSG),
    (
        "11+12",
        params_of(
            stopping=pb.StoppingCriteria(stop_sequences=[""]),
            response=pb.ResponseOptions(generated_tokens=True, top_n_tokens=11),
        ),
        STOP_MSG,
    ),
]


@pytest.mark.parametrize(("rules", "params", "message"), ORDERED_CASES, ids=[c[0] for c in ORDERED_CASES])
def test_first_failing_rule_wins(rules: str, params: GenerationParams, message: str) -> None:
    assert error_of(params) == message


# ---------------------------------------------------------------- rules 15 / 16 and empty input


def test_zero_token_input_is_rejected() -> None:
    assert input_error(0, params_of()) == "input must contain at least one token"
    assert Msg.EMPTY_INPUT == "input must contain at least one token"


def test_input_filling_the_whole_sequence_fails() -> None:
    assert input_error(200, params_of()) == "input tokens (200) plus prefix length (0) must be < 200"


def test_input_longer_than_the_sequence_fails() -> None:
    assert input_error(250, params_of()) == "input tokens (250) plus prefix length (0) must be < 200"


def test_prefix_length_counts_towards_the_sequence_limit() -> None:
    message = input_error(190, params_of(), prefix=10)
    assert message == "input tokens (190) plus prefix length (10) must be < 200"
    accept(189, params_of(), prefix=10)


def test_input_plus_min_new_tokens_over_limit_fails() -> None:
    params = params_of(stopping=pb.StoppingCriteria(min_new_tokens=11, max_new_tokens=50))
    assert input_error(190, params) == (
        "input tokens (190) plus prefix length (0) plus min_new_tokens (11) must be <= 200"
    )
    assert input_error(185, params, prefix=5) == (
        "input tokens (185) plus prefix length (5) plus min_new_tokens (11) must be <= 200"
    )


def test_input_plus_min_new_tokens_equal_to_limit_passes() -> None:
    params = params_of(stopping=pb.StoppingCriteria(min_new_tokens=10, max_new_tokens=50))
    validated = accept(190, params)
    assert validated.max_new_tokens == 10
    assert validated.max_tokens_clamped


def test_rule_15_is_checked_before_rule_16() -> None:
    params = params_of(stopping=pb.StoppingCriteria(min_new_tokens=20))
    assert input_error(200, params) == "input tokens (200) plus prefix length (0) must be < 200"


def test_near_full_input_is_accepted_with_clamped_max_new_tokens() -> None:
    """SPEC §3.3: 198 tokens, min 2, max 100 → accepted, 2 tokens, TOKEN_LIMIT (the clamp flag)."""
    params = params_of(stopping=pb.StoppingCriteria(min_new_tokens=2, max_new_tokens=100))
    validate_params(params, max_new_tokens_limit=MAX_NEW)
    validated = accept(198, params)
    assert validated.max_new_tokens == 2
    assert validated.max_tokens_clamped is True


def test_max_new_tokens_exactly_filling_the_sequence_is_not_clamped() -> None:
    params = params_of(stopping=pb.StoppingCriteria(max_new_tokens=20))
    validated = accept(180, params)
    assert validated.max_new_tokens == 20
    assert validated.max_tokens_clamped is False


def test_clamp_accounts_for_prefix_length() -> None:
    params = params_of(stopping=pb.StoppingCriteria(max_new_tokens=20))
    validated = accept(170, params, prefix=15)
    assert validated.max_new_tokens == 15
    assert validated.max_tokens_clamped is True


def test_short_input_keeps_requested_max_new_tokens() -> None:
    validated = accept(10, params_of(stopping=pb.StoppingCriteria(max_new_tokens=100)))
    assert validated.max_new_tokens == 100
    assert validated.max_tokens_clamped is False


def test_validated_input_carries_text_ids_and_params() -> None:
    params = params_of()
    validated = validate_input(
        "hello", [7, 8, 9], params, prefix_length=0, max_sequence_length=MAX_SEQ, rng=random.Random(0)
    )
    assert validated.text == "hello"
    assert validated.input_ids == (7, 8, 9)
    assert validated.params is params


def test_single_token_input_with_minimal_sequence_length_is_accepted() -> None:
    validated = accept(1, params_of(), max_seq=2)
    assert validated.max_new_tokens == 1
    assert validated.max_tokens_clamped is True


# ---------------------------------------------------------------- seeds (SPEC §2.3)


def test_unseeded_sampling_inputs_get_distinct_32_bit_seeds() -> None:
    params = sample()
    rng = random.Random(1234)
    seeds = [accept(5, params, rng=rng).seed for _ in range(5)]
    assert len(set(seeds)) == 5
    assert all(0 <= seed < 2**32 for seed in seeds)


def test_random_seeds_come_from_the_supplied_rng() -> None:
    params = sample()
    first = [accept(5, params, rng=rng).seed for rng in [random.Random(7)] * 3]
    again = [accept(5, params, rng=rng).seed for rng in [random.Random(7)] * 3]
    assert first == again
    assert len(set(first)) == 3


def test_given_seed_is_used_as_is_for_every_input() -> None:
    params = sample(seed=2**40 + 3)
    rng = random.Random(0)
    assert [accept(5, params, rng=rng).seed for _ in range(5)] == [2**40 + 3] * 5


def test_given_seed_zero_is_used_as_is() -> None:
    assert accept(5, sample(seed=0)).seed == 0
    assert sample(seed=0).sampling.seed == 0


def test_greedy_inputs_get_seed_zero() -> None:
    assert accept(5, params_of()).seed == 0
    assert accept(5, sample(temperature=0.0)).seed == 0


def test_seeding_leaves_the_shared_params_unseeded() -> None:
    params = sample()
    validated = accept(5, params)
    assert validated.params is params
    assert params.sampling.seed is None
