"""Guided JSON sampled from a random tiny model: every output the grammar finishes parses and validates.

A random model at temperature 1 wanders over everything the grammar allows, so many seeds per schema
reach the corners a real model seldom does (control characters, escapes, bounds). The sampler and
its per-row matchers are driven directly, one batch of seeds per schema, with the model's KV cache.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence

import jsonschema
import pytest
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from tests.fixtures.tiny import EOS_ID, make_model
from tgis.guided import Constraint, GrammarCache
from tgis.sampling import BatchSampler, SamplingConfig

PROMPT = "The quick brown fox"
MAX_NEW_TOKENS = 160


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    return make_model("llama", len(tokenizer))


@pytest.fixture(scope="module")
def grammars(tokenizer: PreTrainedTokenizerBase) -> GrammarCache:
    return GrammarCache(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[EOS_ID])


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Each step multiplies a few dozen rows by a 64-wide model: a second thread only adds
    # synchronisation, and on a shared 2-core machine it made these tests ten times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def finished_outputs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    grammar: object,
    seeds: Sequence[int],
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """The texts of the rows, one per seed, whose grammar terminated within max_new_tokens."""
    sampler = BatchSampler(len(tokenizer), [EOS_ID], torch.device("cpu"))
    sampler.add_rows([SamplingConfig(greedy=False, seed=s, guide=grammar) for s in seeds], [[]] * len(seeds))
    prompt = tokenizer(PROMPT)["input_ids"]
    feed = torch.tensor([prompt] * len(seeds))
    cache = DynamicCache()
    rows = list(range(len(seeds)))  # the seed index of each row still running
    generated: list[list[int]] = [[] for _ in seeds]
    finished = []
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            logits = model(input_ids=feed, past_key_values=cache, use_cache=True).logits[:, -1]
        step = sampler.sample(logits.float())
        for row, token in zip(rows, step.token_ids, strict=True):
            generated[row].append(token)
        # A grammar terminates on accepting the stop token, which is no part of the text.
        finished += [generated[rows[p]][:-1] for p in step.guide_finished]
        keep = [p for p in range(len(rows)) if p not in step.guide_finished]
        if not keep:
            break
        if len(keep) < len(rows):
            sampler.keep_rows(keep)
            cache.batch_select_indices(torch.tensor(keep))
            rows = [rows[p] for p in keep]
        feed = torch.tensor([[step.token_ids[p]] for p in keep])
    return tokenizer.batch_decode(finished) if finished else []


def compiled(grammars: GrammarCache, constraint: Constraint) -> object:
    return asyncio.run(grammars.compile(constraint))


def schema_constraint(schema: dict[str, object]) -> Constraint:
    return Constraint("json_schema", json.dumps(schema))


def test_length_bounded_strings_hold_no_raw_control_characters(model, tokenizer, grammars):
    """The reported defect: xgrammar 0.2.8 let a string with maxLength hold U+0000-U+001F unescaped."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 8}},
        "required": ["s"],
        "additionalProperties": False,
    }
    outputs = finished_outputs(model, tokenizer, compiled(grammars, schema_constraint(schema)), range(96))
    assert len(outputs) == 96  # eight characters and a brace: every row finishes
    unparsable = []
    for text in outputs:
        try:
            jsonschema.validate(json.loads(text), schema)
        except json.JSONDecodeError:
            unparsable.append(text)
    assert unparsable == []
