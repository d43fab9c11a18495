r"""The grammar a JSON schema compiles to: xgrammar's, with the rule xgrammar 0.2.9 gets wrong rewritten.

Inside a JSON string, RFC 8259 §7 requires U+0000-U+001F, the quotation mark and the reverse solidus
to be escaped. In xgrammar 0.2.9, one character of a string with minLength or maxLength is
[^"\\\r\n], which admits the raw control characters other than CR and LF, so json.loads rejects what
the rule lets a model write (1 output in 5 of a random model held one).

xgrammar 0.2.8 also got format "email" (a quoted pair as a lone backslash) and the JSON-pointer
formats (raw controls, quotation mark and reverse solidus) wrong; 0.2.9 writes those rules right,
and pyproject pins 0.2.9 because this repair matches its printed text.

The grammar is printed as EBNF, the rule body (matched whole, as 0.2.9 prints it) is replaced, and
the EBNF is parsed again. A release that fixes the rule prints it differently, so the repair no
longer applies; tests/unit/test_json_grammar.py fails then, and this module can go.
"""

from __future__ import annotations

import xgrammar as xgr

# xgrammar 0.2.9's printed body -> the body that admits only valid JSON string text.
REPAIRS: dict[str, str] = {
    # One character of a string with minLength/maxLength. Still one character class, the shape
    # xgrammar precomputes token masks for: a class-or-escape rule measured 2-2000x slower per
    # step on a 64k vocabulary. So such a string still holds no escape, as xgrammar writes it,
    # and loses only the raw controls.
    r"(([^\"\\\r\n]))": r"(([^\"\\\0-\x1f]))",
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
