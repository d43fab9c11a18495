"""Every field an HTTP API defines is either implemented by its request model or refused by name."""

from __future__ import annotations

import pytest

from tgis.errors import ValidationError
from tgis.http import defined_fields as d
from tgis.http.openai_bodies import ChatRequest, CompletionRequest
from tgis.http.tgi_bodies import GenerateRequest, Parameters


def implemented(model) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


@pytest.mark.parametrize(
    ("model", "defined", "refused"),
    [
        (ChatRequest, d.OPENAI_CHAT | d.VLLM_CHAT, d.OPENAI_CHAT_REFUSED),
        (CompletionRequest, d.OPENAI_COMPLETIONS | d.VLLM_COMPLETIONS, d.OPENAI_COMPLETIONS_REFUSED),
        (Parameters, d.TGI_PARAMETERS, d.TGI_PARAMETERS_REFUSED),
        (GenerateRequest, d.TGI_REQUEST, {}),
    ],
    ids=["chat", "completions", "tgi-parameters", "tgi-request"],
)
def test_no_defined_field_is_dropped(model, defined, refused) -> None:
    fields = implemented(model)
    assert defined - fields - set(refused) == set(), "defined, neither implemented nor refused"
    assert set(refused) & fields == set(), "refused and implemented at once"
    assert set(refused) <= defined, "refused but defined by nobody"


def test_beam_search_and_bad_words_are_implemented_on_both_openai_routes() -> None:
    beams = {"use_beam_search", "length_penalty", "early_stopping", "bad_words"}
    for model, refused in (
        (ChatRequest, d.OPENAI_CHAT_REFUSED),
        (CompletionRequest, d.OPENAI_COMPLETIONS_REFUSED),
    ):
        assert beams <= implemented(model) and not beams & set(refused)


@pytest.mark.parametrize(
    "data",
    [{"skip_special_tokens": None}, {"skip_special_tokens": True}, {"prompt_logprobs": 0},
     {"logits_processors": []}, {"nobody_defines_this": [1, 2]}, {"priority": 0}],
)  # fmt: skip
def test_null_and_values_that_ask_for_nothing_pass(data) -> None:
    d.refuse_unimplemented(data, d.OPENAI_COMPLETIONS_REFUSED)


@pytest.mark.parametrize(
    ("data", "name"),
    [({"skip_special_tokens": False}, "skip_special_tokens"), ({"prompt_logprobs": 2}, "prompt_logprobs"),
     ({"priority": True}, "priority"), ({"allowed_token_ids": [1]}, "allowed_token_ids"),
     ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend")],
)  # fmt: skip
def test_a_value_that_asks_for_something_is_refused_by_name(data, name) -> None:
    with pytest.raises(ValidationError) as raised:
        d.refuse_unimplemented(data, d.OPENAI_COMPLETIONS_REFUSED)
    assert raised.value.message == f"{name} is not supported by this server"
