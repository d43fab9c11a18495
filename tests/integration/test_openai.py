"""The OpenAI-compatible routes through the real `openai` client against transformers' generate()."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import openai
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.fixtures.adapters import write_lora
from tests.integration import reference
from tests.integration.harness import ServerThread

PROMPT = "The quick brown fox jumps over"
NEW_TOKENS = 12
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(model_dirs, tmp_path_factory) -> Path:
    """The tiny llama model, with a chat template beside its tokenizer."""
    target = tmp_path_factory.mktemp("chat-llama") / "model"
    shutil.copytree(model_dirs("llama"), target)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return target


@pytest.fixture(scope="module")
def store(chat_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    write_lora(root, "lora/a", chat_model_dir, seed=1)
    return root


@pytest.fixture(scope="module")
def server(chat_model_dir, store) -> Iterator[ServerThread]:
    server = ServerThread(chat_model_dir, prefix_store_path=str(store), served_model_name="tiny")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def post(
    server: ServerThread, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    status, _, raw = server.http_post(path, body, headers)
    return status, json.loads(raw)


def test_models_lists_the_model_and_its_adapters(client) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny", "lora/a"]


def test_greedy_completion_equals_transformers(client, chat_model_dir) -> None:
    expected = reference.greedy(chat_model_dir, PROMPT, NEW_TOKENS)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == expected.input_token_count
    assert reply.usage.completion_tokens == expected.generated_token_count
    assert reply.usage.total_tokens == expected.input_token_count + expected.generated_token_count
    assert reply.choices[0].finish_reason == ("length" if expected.stop_reason == "MAX_TOKENS" else "stop")


def test_streamed_completion_equals_unary_and_ends_with_usage(client) -> None:
    unary = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == unary.choices[0].text
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens


def test_prompt_lists_token_ids_and_n(client, chat_model_dir) -> None:
    expected = reference.greedy(chat_model_dir, PROMPT, NEW_TOKENS)
    tokenizer = reference._load(chat_model_dir)[1]
    ids = tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
    assert by_ids.choices[0].text == expected.text
    several = client.completions.create(
        model="tiny", prompt=[PROMPT, "Hello world"], max_tokens=NEW_TOKENS, temperature=0, n=2
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == expected.text
    other = reference.greedy(chat_model_dir, "Hello world", NEW_TOKENS)
    assert several.choices[2].text == other.text


def test_stop_sequence_cuts_the_text_before_it(client, chat_model_dir) -> None:
    full = reference.greedy(chat_model_dir, PROMPT, NEW_TOKENS).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), "fixture text too short for a stop sequence"
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stop=[stop]
    )
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_logprobs_and_echo(client) -> None:
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 5 == reply.usage.completion_tokens
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    for chosen, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(lp, abs=1e-4)  # greedy: the chosen token is the top one
        assert chosen in top
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + reply.choices[0].text


def test_chat_unary_and_streamed_equal_transformers(client, chat_model_dir) -> None:
    messages = [{"role": "user", "content": "Say something about foxes"}]
    model, tokenizer = reference._load(chat_model_dir)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    generated = reference.greedy_ids(model, ids, NEW_TOKENS)
    expected = reference._expected(tokenizer, generated, reference.end_ids(model), len(ids))
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0, logprobs=True, top_logprobs=3
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == expected.generated_token_count
    content = reply.choices[0].logprobs.content
    assert len(content) == expected.generated_token_count
    assert all(len(t.top_logprobs) == 3 for t in content)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_adapter_chosen_by_model(client, chat_model_dir, store) -> None:
    expected = reference.greedy_with_lora(chat_model_dir, store / "lora/a", PROMPT, NEW_TOKENS)
    reply = client.completions.create(model="lora/a", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.model == "lora/a"


def test_a_model_without_chat_template_gets_400(model_dirs) -> None:
    server = ServerThread(model_dirs("gpt2"))
    try:
        status, body = post(
            server,
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
        )
        assert status == 400
        assert "no chat template" in body["error"]["message"]
    finally:
        server.stop()


def test_errors_are_openai_error_objects(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt=PROMPT, temperature=0.01)
    body = raised.value.body
    assert isinstance(body, dict) and body["message"] == "temperature must be >= 0.05"  # the gRPC message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
    status, body = post(server, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["message"].startswith("request body is not valid JSON")
    status, body = post(
        server, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": "many"}).encode()
    )
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, body = post(
        server, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 10**6}).encode()
    )
    limit = server.server.limits.max_new_tokens
    assert status == 400 and body["error"]["message"] == f"max_new_tokens must be <= {limit}"


class _OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition, for the reference: logit - count*frequency - (count>0)*presence + bias."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]) -> None:
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        penalised = scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence
        for token, bias in self.bias.items():
            penalised[:, token] += bias
        return cast(torch.FloatTensor, penalised)


def test_presence_frequency_penalties_and_logit_bias_equal_transformers_with_the_formula(
    client, chat_model_dir
) -> None:
    model, tokenizer = reference._load(chat_model_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    plain = reference.greedy_ids(model, ids, NEW_TOKENS)
    bias = {plain[1]: -3.0, plain[0]: 1.5}
    processor = _OpenAIPenalties(len(ids), 0.8, 1.6, bias)
    out, start = reference.generate(
        model,
        ids,
        max_new_tokens=NEW_TOKENS,
        logits_processor=LogitsProcessorList([processor]),
        eos_token_id=reference.end_ids(model),
    )
    expected = out[0, start:].tolist()
    assert expected != plain, "the penalties must change this greedy output for the test to mean anything"
    reply = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        presence_penalty=0.8,
        frequency_penalty=1.6,
        logit_bias={str(k): v for k, v in bias.items()},
    )
    text = tokenizer.decode(expected, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert reply.choices[0].text == text.rstrip("\ufffd")
    forced = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(plain[2]): 100}
    )
    forced_text = tokenizer.decode(
        [plain[2]] * 4, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert forced.choices[0].text == forced_text.rstrip("\ufffd")


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"abc": 1}, "logit_bias keys must be token ids (non-negative integers), got 'abc'"),
        ({"-5": 1}, "logit_bias keys must be token ids (non-negative integers), got '-5'"),
        ({"99999999": 1}, "logit_bias token id 99999999 must be in [0, "),
        ({"1": 101}, "logit_bias value for token 1 must be in [-100, 100], got 101"),
    ],
)
def test_bad_logit_bias_is_a_400_with_a_precise_message(client, bias, message) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logit_bias=bias)
    body = raised.value.body
    assert isinstance(body, dict) and body["message"].startswith(message)


# ---- structured output: response_format and vLLM's guided_* extras -------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "string", "pattern": "^[0-9]{1,2}$"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_response_format_json_schema_holds_on_a_random_model(client, seed) -> None:
    import jsonschema

    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Who?"}],
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        **sampling,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice  # the grammar completed within the budget
    jsonschema.validate(json.loads(cast(str, choice.message.content)), PERSON)


def test_json_object_choice_and_regex_hold_streamed_and_unary(client) -> None:
    json_object = client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if json_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(json_object.choices[0].text), dict)
    choices = ["red", "green", "blue"]
    picked = client.completions.create(
        model="tiny",
        prompt="Colour:",
        max_tokens=10,
        temperature=1.0,
        seed=3,
        extra_body={"guided_choice": choices},
    )
    assert picked.choices[0].text in choices
    pattern = r"[0-9]{3}-[a-z]{2}"
    unary = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=12, temperature=0, extra_body={"guided_regex": pattern}
    )
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model="tiny",
            prompt="Code:",
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"guided_regex": pattern},
        )
        if chunk.choices
    )
    import re

    assert re.fullmatch(pattern, unary.choices[0].text)
    assert streamed == unary.choices[0].text


def test_bad_constraints_are_400s_with_the_grpc_messages(server) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"guided_choice": ["only"]}, "Must provide at least two choices"),
        ({"guided_regex": "("}, "invalid guided decoding regex"),
        ({"guided_regex": "a", "guided_choice": ["a", "b"]}, "only one of"),
        ({"response_format": {"type": "json_schema"}}, "needs a json_schema object"),
    ]
    for extra, message in cases:
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4, **extra}).encode()
        status, payload = post(server, "/v1/completions", body)
        assert status == 400, payload
        assert message in payload["error"]["message"], payload


def test_tools_with_a_template_that_cannot_render_them_are_a_400_that_says_so(server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    status, body = post(server, "/v1/chat/completions", json.dumps(request).encode())
    assert status == 400
    assert body["error"]["message"].startswith("this model's chat template does not render tools")
