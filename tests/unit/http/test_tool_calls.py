"""Tool calls read back from constrained text, whole or streamed, and the constraint that produces them."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from tgis.errors import ValidationError
from tgis.guided import TEXT_NOT_A_CALL
from tgis.http.openai_tools import NamedFunction, NamedToolChoice, ToolDefinition, tool_constraint, tool_plan
from tgis.http.tool_calls import ArgumentsDelta, CallStarted, ToolCallReader, read_calls
from tgis.json_grammar import json_schema_grammar

WEATHER = ToolDefinition.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"$ref": "#/$defs/city"}},
                "required": ["city"],
                "$defs": {"city": {"type": "string"}},
            },
        },
    }
)
PING = ToolDefinition.model_validate({"type": "function", "function": {"name": "ping"}})
ONE = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}'
TWO = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "ping", "arguments": {}}]'


def stream(text: str) -> tuple[list[tuple[int, str, str]], str]:
    """Fed one character at a time: the calls started (index, id, name) and all argument text in order."""
    reader = ToolCallReader()
    started, arguments = [], []
    for char in text:
        for event in reader.feed(char):
            if isinstance(event, CallStarted):
                started.append((event.call.index, event.call.id, event.call.name))
            elif isinstance(event, ArgumentsDelta):
                arguments.append((event.index, event.text))
    assert reader.complete
    return started, "|".join("".join(t for i, t in arguments if i == n) for n in range(len(started)))


def test_one_call_whole_and_streamed() -> None:
    calls = read_calls(ONE)
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris {x}'})
    ]
    started, arguments = stream(ONE)
    assert [s[2] for s in started] == ["get_weather"] and arguments == calls[0].arguments


def test_an_array_of_calls_whole_and_streamed() -> None:
    calls = read_calls(TWO)
    assert calls is not None and [c.name for c in calls] == ["get_weather", "ping"]
    assert [c.arguments for c in calls] == ['{"city": "Oslo"}', "{}"]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    started, arguments = stream(TWO)
    assert [(s[0], s[2]) for s in started] == [(0, "get_weather"), (1, "ping")]
    assert arguments == '{"city": "Oslo"}|{}'


@pytest.mark.parametrize("text", [ONE[:-1], TWO[:30], "", "plain text"])
def test_text_that_is_no_whole_call_reads_as_none(text) -> None:
    assert read_calls(text) is None


def test_plans_follow_openai_defaults() -> None:
    assert tool_plan(None, None, None) is None
    assert tool_plan([], "required", None) is None  # nothing to call: answered as none
    assert tool_plan([], "auto", None) is None
    auto = tool_plan([WEATHER, PING], None, None)
    assert auto is not None and (auto.mode, auto.parallel) == ("auto", True)
    named = tool_plan(
        [WEATHER, PING], NamedToolChoice(type="function", function=NamedFunction(name="ping")), True
    )
    assert named is not None and named.mode == "named" and not named.parallel
    assert [t.function.name for t in named.callable] == ["ping"]
    assert [t["function"]["name"] for t in named.template_tools()] == ["ping", "get_weather"]  # type: ignore[index]
    with pytest.raises(ValidationError):
        tool_plan(None, "auto", None)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info)


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) if text else True


def test_required_allows_calls_with_valid_arguments_only(compiler) -> None:
    plan = tool_plan([WEATHER, PING], "required", True)
    assert plan is not None
    constraint = tool_constraint(plan)
    assert constraint is not None and constraint.kind == "tools"
    assert "$defs" in json.loads(constraint.text)  # hoisted: the nested $ref still resolves
    compiled = compiler.compile_grammar(json_schema_grammar(constraint.text))
    assert accepts(compiled, ONE) and accepts(compiled, TWO)
    assert not accepts(compiled, '{"name": "get_weather", "arguments": {"city": 3}}')
    assert not accepts(compiled, '{"name": "nope", "arguments": {}}')
    assert not accepts(compiled, "hello")


def test_auto_allows_a_call_or_text_that_cannot_start_one(compiler) -> None:
    plan = tool_plan([WEATHER], "auto", False)
    assert plan is not None
    constraint = tool_constraint(plan)
    assert constraint is not None and constraint.kind == "tools_or_text"
    grammar = xgr.Grammar.union(json_schema_grammar(constraint.text), xgr.Grammar.from_ebnf(TEXT_NOT_A_CALL))
    compiled = compiler.compile_grammar(grammar)
    assert accepts(compiled, ONE) and accepts(compiled, "It is sunny {or not} [maybe] é")
    assert not accepts(compiled, TWO)  # no parallel calls: no array
    assert not accepts(compiled, "{not a call")
    none = tool_plan([WEATHER], "none", None)
    assert none is not None and tool_constraint(none) is None
