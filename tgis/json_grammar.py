r"""The grammar a JSON schema compiles to: xgrammar's, with the rules xgrammar 0.2.8 gets wrong rewritten.

Inside a JSON string, RFC 8259 §7 requires U+0000-U+001F, the quotation mark and the reverse solidus
to be escaped, and allows only the escapes \" \\ \/ \b \f \n \r \t \uXXXX. xgrammar 0.2.8 breaks this
in three rules, so json.loads rejects what they let a model write:

- a string with minLength or maxLength: one character is [^"\\\r\n], which admits the raw control
  characters other than CR and LF (1 output in 5 of a random model held one);
- format "email": in a quoted local part, a quoted pair is a lone backslash and any printable
  character, which is no JSON escape (\q);
- formats "json-pointer" and "relative-json-pointer": a character of a reference token admits the
  raw control characters, the quotation mark and the reverse solidus.

The grammar is printed as EBNF, each of those rule bodies (matched whole, as 0.2.8 prints it) is
replaced, and the EBNF is parsed again. A release that fixes a rule prints it differently, so its
repair no longer applies; tests/unit/test_json_grammar.py fails then, and once no repair applies
this module can go.
"""

from __future__ import annotations

import xgrammar as xgr

_HEX = "[0-9A-Fa-f]"

# xgrammar 0.2.8's printed body -> the body that admits only valid JSON string text.
REPAIRS: dict[str, str] = {
    # One character of a string with minLength/maxLength. Still one character class, the shape
    # xgrammar precomputes token masks for: a class-or-escape rule measured 2-2000x slower per
    # step on a 64k vocabulary. So such a string still holds no escape, as in 0.2.8, and loses
    # only the raw controls.
    r"(([^\"\\\r\n]))": r"(([^\"\\\0-\x1f]))",
    # Format email, in a quoted local part: a quoted pair (a backslash and a printable ASCII
    # character) is written \\ and the character, escaped itself if it is " or \; or a plain character.
    r'(("\\" [ -~]) | ([ !#-[\]-~]))': (
        r'(("\\\\" [ !#-[\]-~]) | ("\\\\\\\"") | ("\\\\\\\\") | ([ !#-[\]-~]))'
    ),
    # Format json-pointer, one character of a reference token: any but / and ~ (RFC 6901), or ~0
    # or ~1; the quotation mark, the reverse solidus and the controls written as escapes.
    r'(([\0-.]) | ([0-}]) | ([\x7f-\U0010ffff]) | ("~" [01]))': (
        r'(([ !#-.]) | ([0-[\]-}]) | ([\x7f-\U0010ffff]) | ("~" [01]) | ("\\" [\"\\bfnrt]) '
        rf'| ("\\u00" [01] {_HEX}))'
    ),
}


def json_schema_grammar(schema: str) -> xgr.Grammar:
    """The grammar of the JSON texts `schema` admits, with no free whitespace between tokens.

    Without free whitespace a weak model cannot pad without end.
    """
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    printed = str(grammar)
    repaired = repair(printed)
    return grammar if repaired == printed else xgr.Grammar.from_ebnf(repaired)


def repair(ebnf: str) -> str:
    """The EBNF with the body of every rule that is one of REPAIRS' keys replaced by its value."""
    return "\n".join(_repair_rule(line) for line in ebnf.splitlines())


def _repair_rule(line: str) -> str:
    name, separator, body = line.partition(" ::= ")
    return name + separator + REPAIRS.get(body, body) if separator else line
