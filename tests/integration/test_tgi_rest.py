"""TGI's REST routes through HF's real `text-generation` client (0.7.0) against transformers' generate()."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import text_generation
from text_generation.errors import ValidationError

from tests.integration import reference
from tests.integration.harness import ServerThread

PROMPT = "The quick brown fox jumps over"
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def server(model_dirs) -> Iterator[ServerThread]:
    server = ServerThread(model_dirs("gpt2"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> text_generation.Client:
    return text_generation.Client(f"http://127.0.0.1:{server.server.http_port}", timeout=60)


def post(server: ServerThread, path: str, body: object) -> tuple[int, object]:
    status, _, raw = server.http_post(path, json.dumps(body).encode())
    return status, json.loads(raw)


def test_generate_with_details_equals_transformers(client, model_dirs) -> None:
    expected = reference.greedy(model_dirs("gpt2"), PROMPT, NEW_TOKENS)
    reply = client.generate(PROMPT, max_new_tokens=NEW_TOKENS, decoder_input_details=True, top_n_tokens=2)
    assert reply.generated_text == expected.text
    details = reply.details
    assert details.generated_tokens == expected.generated_token_count
    assert details.finish_reason.value == ("length" if expected.stop_reason == "MAX_TOKENS" else "eos_token")
    assert len(details.tokens) == expected.generated_token_count
    assert "".join(t.text for t in details.tokens) == expected.text
    assert all(t.logprob <= 0 for t in details.tokens)
    assert len(details.prefill) == expected.input_token_count and details.prefill[0].logprob is None
    tokenizer = reference._load(model_dirs("gpt2"))[1]
    assert [t.id for t in details.prefill] == tokenizer(PROMPT)["input_ids"]
    assert details.top_tokens is not None
    for token, top in zip(details.tokens, details.top_tokens, strict=True):
        assert top[0].id == token.id  # greedy: the chosen token is the most likely one
        assert len(top) == 2


def test_stream_equals_unary(client) -> None:
    unary = client.generate(PROMPT, max_new_tokens=NEW_TOKENS)
    events = list(client.generate_stream(PROMPT, max_new_tokens=NEW_TOKENS))
    assert [e.token.id for e in events] == [t.id for t in unary.details.tokens]
    assert "".join(e.token.text for e in events) == unary.generated_text
    assert events[-1].generated_text == unary.generated_text
    assert events[-1].details.generated_tokens == unary.details.generated_tokens
    assert all(e.details is None for e in events[:-1])


def test_best_of_returns_the_best_candidate_and_the_others(server) -> None:
    status, body = post(
        server,
        "/generate",
        {
            "inputs": PROMPT,
            "parameters": {"do_sample": True, "best_of": 3, "max_new_tokens": 6, "details": True},
        },
    )
    assert status == 200, body
    assert isinstance(body, dict)
    details = body["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2
    best = sum(t["logprob"] for t in details["tokens"])
    assert all(best >= sum(t["logprob"] for t in o["tokens"]) for o in others)


def test_generate_route_and_info_and_tokenize(server, model_dirs) -> None:
    status, body = post(server, "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert status == 200 and isinstance(body, dict) and set(body) == {"generated_text"}
    status, info = server.http_get("/info")
    assert status == 200 and json.loads(info)["max_total_tokens"] == server.server.limits.max_sequence_length
    status, tokens = post(server, "/tokenize", {"inputs": PROMPT})
    tokenizer = reference._load(model_dirs("gpt2"))[1]
    assert status == 200 and isinstance(tokens, list)
    assert [t["id"] for t in tokens] == tokenizer(PROMPT)["input_ids"]
    assert "".join(t["text"] for t in tokens) == PROMPT


def test_bad_requests_get_400_with_the_grpc_message(client, server) -> None:
    with pytest.raises(ValidationError) as raised:
        client.generate(PROMPT, max_new_tokens=10**6)
    assert str(raised.value) == f"max_new_tokens must be <= {server.server.limits.max_new_tokens}"
    status, body = post(server, "/generate", {"inputs": 3})
    assert status == 400 and isinstance(body, dict) and body["error"].startswith("inputs:")
    status, body = post(server, "/generate", {"inputs": PROMPT, "parameters": {"best_of": 2}})
    assert status == 400 and isinstance(body, dict) and "sampling" in body["error"]


def test_watermark_puts_every_token_on_its_green_list(model_dirs) -> None:
    """WATERMARK_DELTA large enough that the green list always wins: each generated token is in the
    list transformers' processor derives from the token before it (gamma = WATERMARK_GAMMA)."""
    import torch
    from transformers import WatermarkLogitsProcessor

    server = ServerThread(model_dirs("gpt2"), watermark_gamma=0.25, watermark_delta=1000.0)
    try:
        client = text_generation.Client(f"http://127.0.0.1:{server.server.http_port}")
        kwargs = {
            "max_new_tokens": 12,
            "do_sample": True,
            "seed": 7,
            "decoder_input_details": True,
        }
        marked = client.generate("The weather today", watermark=True, **kwargs)
        plain = client.generate("The weather today", **kwargs)
        vocab = server.engine.spec.vocab_size
        green = WatermarkLogitsProcessor(vocab, torch.device("cpu"), greenlist_ratio=0.25, bias=1000.0)
        ids = [t.id for t in marked.details.prefill] + [t.id for t in marked.details.tokens]
        start = len(marked.details.prefill)
        for position in range(start, len(ids)):
            greenlist = green._get_greenlist_ids(torch.LongTensor([ids[position - 1]]))
            assert ids[position] in greenlist.tolist(), position
        plain_ids = [t.id for t in plain.details.tokens]
        assert plain_ids != ids[start:]  # the same seed without the watermark takes other tokens
    finally:
        server.stop()


def test_grammar_regex_and_bad_grammar(server) -> None:
    import re

    status, body = post(
        server,
        "/generate",
        {
            "inputs": "Code:",
            "parameters": {"max_new_tokens": 12, "grammar": {"type": "regex", "value": "[a-c]{4}"}},
        },
    )
    assert status == 200, body
    assert re.fullmatch("[a-c]{4}", body["generated_text"])  # type: ignore[index]
    status, body = post(
        server, "/generate", {"inputs": "x", "parameters": {"grammar": {"type": "lark", "value": "x"}}}
    )
    assert status == 400 and "grammar must be" in json.dumps(body)


def test_every_generation_request_carries_a_correlation_id_back(server) -> None:
    """Generated when the client sends none, else the client's own; on unary and streamed answers."""
    import re

    def headers(path: str, sent: dict[str, str]) -> dict[str, str]:
        body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
        status, received, _ = server.http_post(path, body, sent)
        assert status == 200
        return {k.lower(): v for k, v in received.items()}

    generated = headers("/generate", {})["x-correlation-id"]
    assert re.fullmatch("[0-9a-f]{32}", generated)
    assert headers("/generate", {})["x-correlation-id"] != generated
    assert headers("/generate", {"x-correlation-id": "mine-1"})["x-correlation-id"] == "mine-1"
    assert headers("/generate_stream", {"x-correlation-id": "mine-2"})["x-correlation-id"] == "mine-2"
