"""Tool calling through the `openai` client: every tool_choice, unary and streamed, arguments checked
against each function's JSON schema with jsonschema; the tools reach the model through the template."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.integration import reference

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
BUDGET = 80


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:
    return chat_server.openai_client()


def brace_bias(chat_checkpoint) -> dict[str, int]:
    """A bias that makes the model open its answer with `{`: under `auto` that takes the calls' branch."""
    tokenizer = reference._load(chat_checkpoint.path)[1]
    return {str(tokenizer.convert_tokens_to_ids("{")): 100}


def ask(client: openai.OpenAI, stream: bool, **kwargs: Any) -> tuple[str | None, list[dict[str, str]], str]:
    """(content, calls as {id, name, arguments}, finish_reason) of choice 0, unary or streamed."""
    args: dict[str, Any] = {"model": "chat", "messages": MESSAGES, "max_tokens": BUDGET, "temperature": 0}
    args.update(kwargs)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        return choice.message.content, calls, choice.finish_reason
    content, finish = "", ""
    merged: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = merged.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += (part.function.name if part.function else None) or ""
            call["arguments"] += (part.function.arguments if part.function else None) or ""
        finish = chunk.choices[0].finish_reason or finish
    return (content or None), [merged[i] for i in sorted(merged)], finish


def assert_valid_calls(calls: list[dict[str, str]], names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_required_always_calls_a_tool_whose_arguments_validate(client, stream) -> None:
    content, calls, finish = ask(
        client, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert finish == "tool_calls" and content is None
    assert_valid_calls(calls, set(SCHEMAS))
    assert len(calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_parallel_calls_come_as_an_array_of_calls(client, chat_checkpoint, stream) -> None:
    """Biased to open an array and to close it after its first call (a random model would go on
    calling until max_tokens): the array form, read as calls."""
    tokenizer = reference._load(chat_checkpoint.path)[1]
    bias = {str(tokenizer.convert_tokens_to_ids(t)): 100 for t in ("[", "]")}
    content, calls, finish = ask(client, stream, tools=TOOLS, tool_choice="required", logit_bias=bias)
    assert finish == "tool_calls" and content is None
    assert_valid_calls(calls, set(SCHEMAS))
    unbiased = ask(
        client, False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, logit_bias=bias
    )
    assert unbiased[1], "without parallel calls the bias cannot open an array: still one call"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_named_function_is_the_one_called(client, stream) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = ask(client, stream, tools=TOOLS, tool_choice=choice)
    assert finish == "tool_calls" and content is None
    assert_valid_calls(calls, {"get_time"})
    assert len(calls) == 1


def test_streamed_and_unary_calls_are_the_same(client) -> None:
    _, unary, _ = ask(client, False, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    _, streamed, _ = ask(client, True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in unary]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_auto_takes_the_call_branch_when_the_answer_opens_with_a_brace(
    client, chat_checkpoint, stream
) -> None:
    bias = brace_bias(chat_checkpoint)
    content, calls, finish = ask(client, stream, tools=TOOLS, logit_bias=bias)  # tool_choice: auto by default
    assert finish == "tool_calls" and content is None
    assert_valid_calls(calls, set(SCHEMAS))


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_auto_answers_text_that_cannot_be_taken_for_a_call(client, stream) -> None:
    content, calls, finish = ask(client, stream, tools=TOOLS, tool_choice="auto", max_tokens=12)
    assert calls == [] and finish in ("stop", "length")
    assert content and not content.startswith(("{", "["))


def test_none_never_calls_even_when_the_text_looks_like_one(client, chat_checkpoint) -> None:
    content, calls, _ = ask(
        client, False, tools=TOOLS, tool_choice="none", logit_bias=brace_bias(chat_checkpoint), max_tokens=4
    )
    assert calls == [] and content is not None and content.startswith("{")


def test_tools_reach_the_model_through_the_template(client, chat_checkpoint) -> None:
    tokenizer = reference._load(chat_checkpoint.path)[1]
    rendered = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    reply = client.chat.completions.create(
        model="chat", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0
    )
    assert reply.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_a_follow_up_turn_renders_earlier_calls_and_tool_results(client, chat_checkpoint) -> None:
    first = client.chat.completions.create(
        model="chat", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=BUDGET, temperature=0,
    )  # fmt: skip
    # The template renders the call's id, which the server draws at random: the follow-up names the call
    # by an id of the client's own, so that the prompt compared with transformers' is the same every run.
    call = first.choices[0].message.tool_calls[0].model_copy(update={"id": "call_weather_1"})
    follow_up: list[dict[str, Any]] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(
        model="chat", messages=follow_up, tools=TOOLS, tool_choice="none", max_tokens=6, temperature=0
    )
    model, tokenizer = reference._load(chat_checkpoint.path)
    as_template_wants = [  # the arguments as an object, as chat templates take them
        *follow_up[:1],
        {**follow_up[1], "tool_calls": [{**call.model_dump(), "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        follow_up[2],
    ]  # fmt: skip
    rendered = tokenizer.apply_chat_template(
        as_template_wants, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "sunny, 21 C" in rendered and call.function.name in rendered and call.id in rendered
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)
    generated = reference.greedy_ids(model, ids, 6)
    expected = reference._expected(tokenizer, generated, reference.end_ids(model), len(ids))
    assert reply.choices[0].message.content == expected.text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
         "tool_choice names the function 'nope', which is not among tools"),
        ({"tool_choice": "required"}, "tool_choice needs tools: no tools were given"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "a function name is 1 to 64"),
        ({"tools": [WEATHER, WEATHER]}, "tools must have distinct function names"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice other than none cannot be combined with response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "invalid guided decoding tools"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}]},
         "messages.0.tool_calls.0.function.arguments is not valid JSON"),
        ({"functions": [{"name": "f"}]}, "functions is not supported by this server"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_that_say_why(chat_server, body, message) -> None:
    request = {"model": "chat", "messages": MESSAGES, "max_tokens": 4, **body}
    status, _, raw = chat_server.http_post("/v1/chat/completions", json.dumps(request).encode())
    assert status == 400, raw
    assert message in json.loads(raw)["error"]["message"]
