"""The repaired JSON-schema grammars: which texts they admit, and that each repair still applies."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from tgis.json_grammar import REPAIRS, json_schema_grammar

Schema = dict[str, object]

BOUNDED: Schema = {"type": "string", "minLength": 2, "maxLength": 3}
EMAIL: Schema = {"type": "string", "format": "email"}
POINTER: Schema = {"type": "string", "format": "json-pointer"}
RELATIVE_POINTER: Schema = {"type": "string", "format": "relative-json-pointer"}


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    # Matching text needs no real vocabulary: one token, the stop token.
    return xgr.GrammarCompiler(xgr.TokenizerInfo(["</s>"], stop_token_ids=[0]), cache_enabled=False)


def admits(compiler: xgr.GrammarCompiler, schema: Schema, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_grammar(json.dumps(schema))))
    return matcher.accept_string(text) and matcher.is_completed()


def printed_bodies(schema: Schema) -> set[str]:
    """The rule bodies of xgrammar's own grammar for the schema, unrepaired."""
    printed = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return {line.partition(" ::= ")[2] for line in printed.splitlines()}


@pytest.mark.parametrize(
    ("schema", "body"),
    [(BOUNDED, 0), ({"type": "object", "propertyNames": {"maxLength": 2}}, 0)],
    ids=["string_length", "property_name_length"],
)
def test_every_repair_applies_to_this_xgrammar(schema, body):
    """When this fails, xgrammar prints the rule differently: see whether the defect is gone
    (then drop the repair, and tgis/json_grammar.py once none is left) or update the key."""
    assert list(REPAIRS)[body] in printed_bodies(schema)


@pytest.mark.parametrize(
    ("text", "admitted"),
    [
        ('"ab"', True),
        ('"a\x0b"', False),  # the reported defect: a raw control character
        ('"a\tb"', False),
        ('"\x00\x1f"', False),
        ('"é😀"', True),  # characters, not bytes, are counted
        ('"a"', False),
        ('"abcd"', False),
    ],
)
def test_length_bounded_strings_admit_no_raw_control_character(compiler, text, admitted):
    assert admits(compiler, BOUNDED, text) is admitted
    if admitted:
        assert 2 <= len(json.loads(text)) <= 3


def test_property_names_with_a_length_admit_no_raw_control_character(compiler):
    schema: Schema = {
        "type": "object",
        "propertyNames": {"maxLength": 2},
        "additionalProperties": {"type": "null"},
    }
    assert admits(compiler, schema, '{"ab": null}')
    assert not admits(compiler, schema, '{"a\x10": null}')


@pytest.mark.parametrize(
    ("text", "admitted"),
    [
        (r'"a.b@example.org"', True),
        (r'"\"a b\"@example.org"', True),
        (r'"\"a\q\"@example.org"', False),  # 0.2.8 admitted this: \q is no JSON escape
        (r'"\"a\\q\"@example.org"', True),  # the quoted pair \q, JSON-encoded
        (r'"\"a\\\"\"@example.org"', True),  # the quoted pair \"
        (r'"\"a\\\\\"@example.org"', True),  # the quoted pair \\
    ],
)
def test_email_quoted_pairs_are_json_escapes(compiler, text, admitted):
    assert admits(compiler, EMAIL, text) is admitted
    if admitted:
        assert "@" in json.loads(text)


@pytest.mark.parametrize("schema", [POINTER, RELATIVE_POINTER], ids=["absolute", "relative"])
@pytest.mark.parametrize(
    ("token", "admitted"),
    [
        ("a~0b~1", True),
        ("a\x01", False),  # raw controls, quotation mark and reverse solidus: 0.2.8 admitted them
        ('a"b', False),
        (r"a\q", False),
        (r"a\u001f\"\\", True),  # the same characters as escapes
        (r"a\/", True),  # an escaped solidus: "/a/", a pointer of two reference tokens
    ],
)
def test_json_pointer_characters_are_json_text(compiler, schema, token, admitted):
    text = f'"{"0" if schema is RELATIVE_POINTER else ""}/{token}"'
    assert admits(compiler, schema, text) is admitted
    if admitted:
        assert json.loads(text).endswith(json.loads(f'"{token}"'))


def test_a_schema_without_a_defective_rule_keeps_xgrammars_grammar():
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    assert str(json_schema_grammar(schema)) == str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
