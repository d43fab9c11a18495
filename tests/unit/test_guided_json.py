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

from engines.common import cache_keyword
from tests.fixtures.tiny import EOS_ID, make_model
from tgis.guided import ANY_JSON_OBJECT_SCHEMA, Constraint, GrammarCache
from tgis.http.tgi import grammar_constraint
from tgis.pb import generation_pb2 as pb
from tgis.rpc.params import constraint_of
from tgis.sampling import BatchSampler, SamplingConfig

PROMPT = "The quick brown fox"
MAX_NEW_TOKENS = 160
SEEDS = range(64)
# The formats whose grammar in xgrammar 0.2.9 admits only valid values (and that jsonschema checks
# without extra packages). Not date: any day 01-31 in any month (2024-02-31); nor ipv4 and ipv6:
# dotted quads with leading zeros (1.02.3.4), which Python's ipaddress refuses.
FORMATS = jsonschema.FormatChecker(formats=("email", "uuid"))


def _string(**keywords: object) -> dict[str, object]:
    return {"type": "string", **keywords}


def _closed(properties: dict[str, object], required: Sequence[str] | None = None) -> dict[str, object]:
    """An object with these properties (all required unless told), no others."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
# The JSON-schema keywords xgrammar 0.2.9 turns into grammar (it ignores allOf, not, if/then/else,
# uniqueItems, contains and dependentRequired), each schema small enough that most rows finish
# within MAX_NEW_TOKENS; strings are mostly length-bounded for the same reason.
CATALOGUE: dict[str, dict[str, object]] = {
    "string_length": _closed(
        {
            "code": _string(minLength=2, maxLength=4),
            "note": _string(maxLength=12),
            "tag": _string(minLength=1),
        }
    ),
    "root_string_length": _string(minLength=3, maxLength=10),
    "pattern": _closed(
        {"id": _string(pattern="^[A-Z]{2}-[0-9]{3}$"), "slug": _string(pattern="^[a-z]+(_[a-z]+)?$")}
    ),
    "formats": _closed(
        {
            "day": _string(format="date"),
            "at": _string(format="date-time"),
            "id": _string(format="uuid"),
            "v4": _string(format="ipv4"),
            "v6": _string(format="ipv6"),
        }
    ),
    "email": _string(format="email"),
    "json_pointer": _closed(
        {"p": _string(format="json-pointer"), "r": _string(format="relative-json-pointer")}
    ),
    "enum_const": _closed(
        {
            "kind": {"enum": ["cat", "dog", 'say "hi"\n', "tab\there", 7, None, True]},
            "version": {"const": "v1\u0001"},
            "meta": {"const": {"a": [1, "b"]}},
        }
    ),
    "nested_objects": _closed(
        {
            "user": _closed(
                {"name": _string(maxLength=6), "address": _closed({"zip": _string(pattern="^[0-9]{5}$")})}
            ),
            "ok": {"type": "boolean"},
        }
    ),
    "arrays": _closed(
        {
            "digits": {"type": "array", "items": DIGIT, "minItems": 2, "maxItems": 4},
            "pairs": {"type": "array", "items": _closed({"k": _string(maxLength=3)}), "maxItems": 2},
            "tuple": {"type": "array", "prefixItems": [DIGIT, {"type": "boolean"}], "items": False},
        }
    ),
    "numbers": _closed(
        {
            "small": {"type": "integer", "minimum": -5, "maximum": 5},
            "open": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "temp": {"type": "number", "minimum": -2.5, "maximum": 40},
            "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
        }
    ),
    "any_one_of": _closed(
        {
            "any": {"anyOf": [{"type": "integer", "maximum": 3}, _string(maxLength=3), {"type": "null"}]},
            "one": {"oneOf": [{"type": "boolean"}, {"enum": ["x", "y"]}, _closed({"z": DIGIT})]},
            "either": {"type": ["string", "null"], "maxLength": 2},
        }
    ),
    "refs": {
        "$defs": {
            "point": _closed({"x": DIGIT, "y": DIGIT}),
            "chain": _closed({"v": DIGIT, "next": {"$ref": "#/$defs/chain"}}, required=["v"]),
        },
        **_closed(
            {
                "from": {"$ref": "#/$defs/point"},
                "to": {"$ref": "#/$defs/point"},
                "list": {"$ref": "#/$defs/chain"},
            }
        ),
    },
    "additional_properties_schema": {
        "type": "object",
        "properties": {"on": {"type": "boolean"}},
        "required": ["on"],
        "propertyNames": {"maxLength": 4},
        "additionalProperties": DIGIT,
        "minProperties": 2,
        "maxProperties": 3,
    },
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^n_[a-z]{1,3}$": DIGIT},
        "additionalProperties": False,
        "maxProperties": 3,
    },
    "required_and_optional": _closed(
        {"a": DIGIT, "b": _string(maxLength=4), "c": {"type": "boolean"}, "d": {"type": "null"}},
        required=["a", "c"],
    ),
}


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
            logits = model(input_ids=feed, use_cache=True, **{cache_keyword(model): cache}).logits[:, -1]
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
    """The reported defect: xgrammar (0.2.8, 0.2.9) lets a string with maxLength hold U+0000-U+001F
    unescaped."""
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


def assert_all_valid(outputs: Sequence[str], schema: dict[str, object], least: int) -> None:
    """At least `least` outputs, and every one parses and validates."""
    assert len(outputs) >= least, f"only {len(outputs)} rows finished"
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
    for text in outputs:
        validator.validate(json.loads(text))


@pytest.mark.parametrize("name", CATALOGUE)
def test_every_finished_output_parses_and_validates(model, tokenizer, grammars, name):
    schema = CATALOGUE[name]
    outputs = finished_outputs(model, tokenizer, compiled(grammars, schema_constraint(schema)), SEEDS)
    assert_all_valid(outputs, schema, least=len(SEEDS) // 8)


def test_format_json_outputs_are_json_objects(model, tokenizer, grammars):
    """`format: JSON` (and OpenAI's json_object): any object, strings without bounds."""
    constraint = constraint_of(
        pb.Parameters(decoding=pb.DecodingParameters(format=pb.DecodingParameters.JSON))
    )
    assert constraint is not None
    outputs = finished_outputs(model, tokenizer, compiled(grammars, constraint), SEEDS)
    assert_all_valid(outputs, json.loads(ANY_JSON_OBJECT_SCHEMA), least=len(SEEDS) // 8)
    assert all(isinstance(json.loads(text), dict) for text in outputs)


@pytest.mark.parametrize("as_text", [False, True], ids=["object", "text"])
def test_tgi_json_grammar_outputs_validate(model, tokenizer, grammars, as_text):
    """TGI's grammar {"type": "json"}, its schema given as an object or as JSON text."""
    schema = CATALOGUE["string_length"]
    constraint = grammar_constraint({"type": "json", "value": json.dumps(schema) if as_text else schema})
    assert constraint is not None
    outputs = finished_outputs(model, tokenizer, compiled(grammars, constraint), SEEDS)
    assert_all_valid(outputs, schema, least=len(SEEDS) // 8)
