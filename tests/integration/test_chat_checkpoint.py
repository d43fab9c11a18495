"""A checkpoint served as its author meant: every end id generation_config.json names stops generation on
every API (EOS_TOKEN), its sampling values are the OpenAI routes' defaults, and gRPC stays greedy."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.integration import reference
from tgis.pb import generation_pb2 as pb

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def client(chat_server) -> openai.OpenAI:
    return chat_server.openai_client()


@pytest.fixture(scope="module")
def prompt(chat_checkpoint) -> str:
    from tests.fixtures.chat import EOS_MESSAGES

    tokenizer = reference._load(chat_checkpoint.path)[1]
    return tokenizer.apply_chat_template(EOS_MESSAGES, tokenize=False, add_generation_prompt=True)


def transformers_answer(chat_checkpoint, prompt: str) -> tuple[list[int], str]:
    """generate() as transformers runs this checkpoint: its generation_config.json's end ids, greedy."""
    model, tokenizer = reference._load(chat_checkpoint.path)
    ids = tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            top_k=None,
            temperature=None,
        )
    generated = out[0, len(ids) :].tolist()
    text = tokenizer.decode(generated[:-1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return generated, text


def test_the_second_end_id_really_ends_transformers_generation(chat_checkpoint, prompt) -> None:
    generated, _ = transformers_answer(chat_checkpoint, prompt)
    assert generated[-1] == chat_checkpoint.second_eos and len(generated) < NEW_TOKENS
    assert reference._load(chat_checkpoint.path)[0].config.eos_token_id != chat_checkpoint.second_eos


def test_grpc_stops_at_it_with_eos_token_and_stays_greedy(chat_server, chat_checkpoint, prompt) -> None:
    generated, text = transformers_answer(chat_checkpoint, prompt)
    params = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS))  # no method: greedy
    reply = chat_server.stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=prompt)], params=params), timeout=60
    ).responses[0]
    assert reply.stop_reason == pb.EOS_TOKEN
    assert reply.generated_token_count == len(generated) == chat_checkpoint.stop_index + 1
    assert reply.text == text
    assert reply.seed == 0  # greedy: TGIS's default, whatever generation_config.json recommends


def test_openai_and_tgi_stop_at_it_too(chat_server, client, chat_checkpoint, prompt) -> None:
    generated, text = transformers_answer(chat_checkpoint, prompt)
    completion = client.completions.create(model="chat", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    assert completion.choices[0].text == text and completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == len(generated)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    status, _, raw = chat_server.http_post("/generate", json.dumps(body).encode())
    answer = json.loads(raw)
    assert status == 200 and answer["generated_text"] == text
    assert answer["details"]["finish_reason"] == "eos_token"
    assert answer["details"]["tokens"][-1]["id"] == chat_checkpoint.second_eos


def test_openai_requests_default_to_the_checkpoint_sampling_values(client, chat_checkpoint, prompt) -> None:
    """generation_config.json says top_k 1 (and temperature 0.7): a request that sets neither samples with
    them, so any seed draws the greedy tokens; one that sets its own top_k samples from more."""
    _, text = transformers_answer(chat_checkpoint, prompt)
    for seed in (1, 2, 3):
        sampled = client.completions.create(model="chat", prompt=prompt, max_tokens=NEW_TOKENS, seed=seed)
        assert sampled.choices[0].text == text
    mine = {
        client.completions.create(
            model="chat", prompt=prompt, max_tokens=NEW_TOKENS, seed=seed, extra_body={"top_k": -1}
        )
        .choices[0]
        .text
        for seed in (1, 2, 3)
    }
    assert mine != {text}, "the request's own top_k must win over the checkpoint's"


def test_stop_token_ids_end_an_openai_request_as_eos_does(client, chat_checkpoint) -> None:
    plain = reference.greedy(chat_checkpoint.path, "The quick brown fox", NEW_TOKENS)
    model, tokenizer = reference._load(chat_checkpoint.path)
    ids = tokenizer("The quick brown fox")["input_ids"]
    generated = reference.greedy_ids(model, ids, NEW_TOKENS)
    stop = generated[2]
    reply = client.completions.create(
        model="chat", prompt="The quick brown fox", max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"stop_token_ids": [stop]},
    )  # fmt: skip
    first = generated.index(stop)
    text = tokenizer.decode(generated[:first], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert reply.choices[0].text == text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == first + 1
    held = client.completions.create(
        model="chat", prompt="The quick brown fox", max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"stop_token_ids": [stop], "min_tokens": first + 2},
    )  # fmt: skip
    assert held.usage.completion_tokens >= first + 2 and plain.text  # the minimum held the stop id back


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"min_p": 1.5}, "min_p must be >= 0.0 and <= 1.0"),
        ({"min_p": -0.1}, "min_p must be >= 0.0 and <= 1.0"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids must be in [0, "),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be in [0, "),
        ({"use_beam_search": True}, "temperature is not supported with use_beam_search"),
        ({"use_beam_search": True, "temperature": 0, "stream": True}, "use_beam_search cannot stream"),
        ({"length_penalty": 2.0}, "length_penalty applies to beam search only"),
        ({"early_stopping": True}, "early_stopping applies to beam search only"),
        ({"bad_words": [" "]}, "bad_words entries must not be empty"),
        ({"skip_special_tokens": False}, "skip_special_tokens is not supported by this server"),
        ({"suffix": "and then"}, "suffix is not supported by this server"),
        ({"priority": 1}, "priority is not supported by this server"),
    ],
)
def test_openai_fields_defined_but_not_implemented_or_out_of_range_are_400s(
    chat_server, body, message
) -> None:
    request = {"model": "chat", "prompt": "Hi", "max_tokens": 2, "temperature": 1.0, **body}
    status, _, raw = chat_server.http_post("/v1/completions", json.dumps(request).encode())
    assert status == 400 and json.loads(raw)["error"]["message"].startswith(message), raw


def test_fields_nobody_defines_and_no_op_values_are_accepted(chat_server) -> None:
    request = {
        "model": "chat", "prompt": "Hi", "max_tokens": 2, "made_up_field": 1, "use_beam_search": False,
        "length_penalty": 1.0, "store": False, "bad_words": [], "min_p": 0.1, "temperature": 0.9,
    }  # fmt: skip
    status, _, raw = chat_server.http_post("/v1/completions", json.dumps(request).encode())
    assert status == 200, raw


def test_tgi_min_p_samples_and_frequency_penalty_is_refused(chat_server) -> None:
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "min_p": 1.0, "seed": 4, "details": True}}
    status, _, raw = chat_server.http_post("/generate", json.dumps(body).encode())
    greedy = {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "details": True}}
    assert status == 200
    # min_p 1 keeps the top token alone: sampling it draws the greedy tokens, with a seed reported
    answer, plain = (
        json.loads(raw),
        json.loads(chat_server.http_post("/generate", json.dumps(greedy).encode())[2]),
    )
    assert answer["generated_text"] == plain["generated_text"] and answer["details"]["seed"] == 4
    bad = {"inputs": "Hi", "parameters": {"min_p": 2}}
    status, _, raw = chat_server.http_post("/generate", json.dumps(bad).encode())
    assert status == 400 and json.loads(raw)["error"] == "min_p must be >= 0.0 and <= 1.0"
    refused = {"inputs": "Hi", "parameters": {"frequency_penalty": 0.5}}
    status, _, raw = chat_server.http_post("/generate", json.dumps(refused).encode())
    assert (
        status == 400
        and json.loads(raw)["error"] == "parameters.frequency_penalty is not supported by this server"
    )


def test_runtime_lora_routes_are_off_unless_enabled(chat_server) -> None:
    body = json.dumps({"lora_name": "x", "lora_path": "/tmp"}).encode()
    assert chat_server.http_post("/v1/load_lora_adapter", body)[0] == 404
    assert chat_server.http_post("/v1/unload_lora_adapter", body)[0] == 404
