"""generation_config.json: every end id it names joins config.json's, and the sampling values it sets
explicitly become the OpenAI routes' defaults (a request's own values win)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import LlamaConfig

from engines.common import config_eos_token_ids
from tgis.http.openai_bodies import CompletionRequest, generation_params
from tgis.startup.generation_defaults import sampling_defaults
from tgis.types import DecodingMethod, SamplingDefaults


def checkpoint(tmp_path: Path, generation: dict | None) -> Path:
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_end_ids_are_config_json_then_generation_config_ones(tmp_path) -> None:
    config = LlamaConfig(eos_token_id=2)
    assert config_eos_token_ids(config, checkpoint(tmp_path, {"eos_token_id": [2, 128009, 7]})) == (
        2,
        128009,
        7,
    )
    assert config_eos_token_ids(LlamaConfig(eos_token_id=[5, 6]), tmp_path) == (5, 6, 2, 128009, 7)
    assert config_eos_token_ids(config) == (2,)  # no checkpoint directory: config.json alone


def test_no_or_unreadable_generation_config_changes_nothing(tmp_path, caplog) -> None:
    assert config_eos_token_ids(LlamaConfig(eos_token_id=2), tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert config_eos_token_ids(LlamaConfig(eos_token_id=2), tmp_path) == (2,)
    assert "is not readable, so it is ignored" in caplog.text
    assert sampling_defaults(tmp_path) == SamplingDefaults()


def test_only_the_values_the_file_sets_are_defaults_and_they_are_logged(tmp_path, caplog) -> None:
    path = checkpoint(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 50})
    with caplog.at_level(logging.INFO, logger="tgis.startup.generation_defaults"):
        defaults = sampling_defaults(path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.9)  # transformers' own top_k 50 is not one
    assert "temperature=0.6 top_p=0.9" in caplog.text
    assert sampling_defaults(path, "vllm") == SamplingDefaults()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, (0.6, 0.9, 5, 0.1, 1.2)),
        ({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
         (1.0, 1.0, 0, 0.0, 1.0)),
        ({"top_k": 3}, (0.6, 0.9, 3, 0.1, 1.2)),
    ],
)  # fmt: skip
def test_a_request_own_values_win_over_the_checkpoint_ones(body, expected) -> None:
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2)
    request = CompletionRequest.model_validate({"prompt": "x", **body})
    params = generation_params(
        request, max_tokens=4, top_n=None, input_details=False, vocab_size=10, defaults=defaults
    )
    s = params.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, params.repetition_penalty) == expected
    assert params.method == DecodingMethod.SAMPLE


def test_temperature_zero_is_greedy_whatever_the_defaults() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_k=5)
    request = CompletionRequest.model_validate({"prompt": "x", "temperature": 0})
    params = generation_params(
        request, max_tokens=4, top_n=None, input_details=False, vocab_size=10, defaults=defaults
    )
    assert params.is_greedy and params.sampling.top_k == 0
