"""Beam search and bad words through the real server and clients, against transformers' generate().

Causal models run beams as forked sequences on the paged engine; encoder-decoder models (t5) as copied
rows on the padded engine. Both must return transformers' beams, best first, with its scores.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fixtures.tiny import EOS_ID
from tests.integration import reference
from tests.integration.harness import ServerThread, metric, wait_until
from tgis.sampling.bad_words import word_sequences

NEW_TOKENS = 10
SCORE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Beam:
    text: str
    score: float
    finish_reason: str
    tokens: int = 0  # generated, ending id included (the reference's only)


@pytest.fixture(scope="module", params=["llama", "t5"])
def served(request, model_dirs) -> Iterator[tuple[ServerThread, Path]]:
    model_dir = model_dirs(request.param)
    server = ServerThread(model_dir, kv_block_size=4, served_model_name="tiny")
    yield server, model_dir
    server.stop()


def reference_beams(
    model_dir: Path,
    ids: Sequence[int],
    width: int,
    *,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    ending: Sequence[int] = (EOS_ID,),
    bad_words: Sequence[Sequence[int]] | None = None,
) -> list[Beam]:
    """transformers' generate(num_beams=width, num_return_sequences=width): each beam's text (its ending id
    left out, as the server leaves it out), score and finish reason."""
    model, tokenizer = reference._load(model_dir)
    out, start = reference.generate(
        model,
        ids,
        num_beams=width,
        num_return_sequences=width,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=list(ending),
        bad_words_ids=[list(s) for s in bad_words] if bad_words else None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    beams = []
    for row, score in zip(out.sequences[:, start:].tolist(), out.sequences_scores.tolist(), strict=True):
        ends = [i for i, token in enumerate(row) if token in ending]
        generated = row[: ends[0]] if ends else row
        text = tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        beams.append(Beam(text, score, "stop" if ends else "length", len(generated) + bool(ends)))
    return beams


def prompt_ids(model_dir: Path, text: str) -> list[int]:
    return list(reference._load(model_dir)[1](text)["input_ids"])


def first_greedy_token(model_dir: Path, ids: Sequence[int], position: int) -> int:
    model, _ = reference._load(model_dir)
    return reference.greedy_ids(model, ids, position + 1)[position]


def extra(choice: Any, name: str) -> Any:
    """A field the openai client does not model (vLLM's beam scores)."""
    assert choice.model_extra is not None
    return choice.model_extra[name]


def served_beams(choices) -> list[Beam]:
    return [Beam(c.text, extra(c, "beam_score"), c.finish_reason) for c in choices]


def assert_same_beams(got: Sequence[Beam], expected: Sequence[Beam], length_penalty: float = 1.0) -> None:
    assert [(b.text, b.finish_reason) for b in got] == [(b.text, b.finish_reason) for b in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert math.isclose(mine.score, theirs.score, abs_tol=SCORE_TOLERANCE), (mine, theirs)


CASES = [
    # prompt, width, length_penalty, early_stopping, which greedy token also ends a beam (None: EOS only)
    ("The quick brown fox", 4, 1.0, False, None),
    ("Hello there", 3, 0.5, True, 0),
    ("Once upon a time", 2, 2.0, "never", 0),
    ("Once upon a time", 4, 1.0, False, 0),
    ("Abc def", 4, -0.5, True, 2),
]


@pytest.mark.parametrize(("prompt", "width", "penalty", "early", "stop_at"), CASES)
def test_beams_equal_transformers_generate(served, prompt, width, penalty, early, stop_at) -> None:
    server, model_dir = served
    ids = prompt_ids(model_dir, prompt)
    # A token the model is likely to pick also ends a beam (stop_token_ids), so beams finish early
    # and the early-stopping rules decide, not only the token budget.
    ending = [EOS_ID] if stop_at is None else [EOS_ID, first_greedy_token(model_dir, ids, stop_at)]
    fields: dict[str, Any] = {"use_beam_search": True, "length_penalty": penalty, "early_stopping": early}
    if stop_at is not None:
        fields["stop_token_ids"] = ending[1:]
    answer = server.openai_client().completions.create(
        model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, n=width, temperature=0, extra_body=fields
    )
    expected = reference_beams(
        model_dir, ids, width, length_penalty=penalty, early_stopping=early, ending=ending
    )
    assert_same_beams(served_beams(answer.choices), expected)
    for choice, beam in zip(answer.choices, expected, strict=True):  # the sum before the length penalty
        cumulative = extra(choice, "cumulative_logprob")
        assert math.isclose(cumulative, beam.score * beam.tokens**penalty, rel_tol=1e-4, abs_tol=1e-4)
    assert answer.usage is not None and answer.usage.completion_tokens == sum(
        beam.tokens for beam in expected
    )  # every beam counts
    assert server.kv_blocks().admitted == 0


def test_chat_returns_the_beams_of_the_rendered_conversation(served, tmp_path) -> None:
    server, model_dir = served
    tokenizer = reference._load(model_dir)[1]
    if tokenizer.chat_template is None:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    server.server.model.tokenizer.hf.chat_template = tokenizer.chat_template
    messages: list[Any] = [{"role": "user", "content": "Name a colour"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    answer = server.openai_client().chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=NEW_TOKENS,
        n=3,
        extra_body={"use_beam_search": True, "temperature": 0},
    )
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    expected = reference_beams(model_dir, ids, 3)
    got = [Beam(c.message.content or "", extra(c, "beam_score"), c.finish_reason) for c in answer.choices]
    assert_same_beams(got, expected)


def test_a_beam_request_runs_beside_greedy_ones_and_each_keeps_its_answer(served) -> None:
    server, model_dir = served
    client = server.openai_client()
    prompts = ["Hello world", "The quick brown fox", "Once upon a time"]

    def greedy(prompt: str) -> str:
        return (
            client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
            .choices[0]
            .text
        )

    def beams() -> list[Beam]:
        answer = client.completions.create(
            model="tiny", prompt="Abc def", max_tokens=NEW_TOKENS, n=4, extra_body={"use_beam_search": True}
        )
        return served_beams(answer.choices)

    with ThreadPoolExecutor(4) as pool:
        found = pool.submit(beams)
        texts = list(pool.map(greedy, prompts))
    assert_same_beams(found.result(), reference_beams(model_dir, prompt_ids(model_dir, "Abc def"), 4))
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == reference.greedy(model_dir, prompt, NEW_TOKENS).text


def test_beams_beside_speculating_requests_keep_both_answers(model_dirs) -> None:
    model_dir = model_dirs("llama")
    server = ServerThread(model_dir, speculator_name="ngram", speculator_tokens=5, served_model_name="tiny")
    try:
        client = server.openai_client()
        prompt = "one two three one two three one two three one two"

        def greedy() -> str:
            return (
                client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
                .choices[0]
                .text
            )

        def beams() -> list[Beam]:
            return served_beams(
                client.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=NEW_TOKENS,
                    n=3,
                    extra_body={"use_beam_search": True},
                ).choices
            )

        with ThreadPoolExecutor(3) as pool:
            found: list[Future[Any]] = [pool.submit(beams), pool.submit(greedy), pool.submit(greedy)]
        assert_same_beams(found[0].result(), reference_beams(model_dir, prompt_ids(model_dir, prompt), 3))
        assert found[1].result() == found[2].result() == reference.greedy(model_dir, prompt, NEW_TOKENS).text
        assert set(server.loop.runner.tracked().values()) == {0}
    finally:
        server.stop()


def test_kv_blocks_grow_where_beams_diverge_not_with_the_width(model_dirs) -> None:
    server = ServerThread(model_dirs("llama"), kv_block_size=4, served_model_name="tiny")
    try:
        runner = server.loop.runner
        pool = runner.planner.pool
        peak = [0]
        step = server.engine.step

        def counting_step(batch):
            peak[0] = max(peak[0], pool.usage().used)
            return step(batch)

        server.engine.step = counting_step
        prompt = "The quick brown fox jumps over the lazy dog and runs far away into the woods " * 3
        prompt_blocks = -(-len(prompt_ids(model_dirs("llama"), prompt)) // 4)
        width = 4
        server.openai_client().completions.create(
            model="tiny", prompt=prompt, max_tokens=8, n=width, extra_body={"use_beam_search": True}
        )
        # Each further beam holds its own 8 positions (2 blocks), the copy of the block it branched
        # in, and one more while a step forks before it frees: never another copy of the prompt.
        assert prompt_blocks >= 8
        assert peak[0] <= prompt_blocks + 2 + (width - 1) * 4
        assert peak[0] < 2 * prompt_blocks
        assert server.kv_blocks().blocks_used == 0
        assert set(runner.tracked().values()) == {0}
    finally:
        server.stop()


def test_a_beam_search_wider_than_the_kv_pool_is_a_400_and_one_that_fits_runs(model_dirs) -> None:
    # 20 blocks of 4 positions: 16 beams of 40 tokens could never be held at once; 2 beams of 8 can.
    server = ServerThread(
        model_dirs("llama"), kv_cache_manager_num_gpu_blocks=20, kv_block_size=4, max_sequence_length=64,
        served_model_name="tiny",
    )  # fmt: skip
    try:
        client = server.openai_client()
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model="tiny", prompt="Hello", max_tokens=40, n=16, extra_body={"use_beam_search": True}
            )
        assert "could never be scheduled" in str(refused.value)
        answer = client.completions.create(
            model="tiny", prompt="Hello", max_tokens=8, n=2, extra_body={"use_beam_search": True}
        )
        assert len(answer.choices) == 2 and server.kv_blocks().blocks_used == 0
    finally:
        server.stop()


def test_streaming_a_beam_request_is_refused_with_the_reason(served) -> None:
    server, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        server.openai_client().completions.create(
            model="tiny", prompt="Hi", max_tokens=4, n=2, stream=True, extra_body={"use_beam_search": True}
        )
    assert "use_beam_search cannot stream" in str(refused.value)
    status, _, raw = server.http_post(
        "/v1/completions",
        json.dumps({"prompt": "Hi", "use_beam_search": True, "n": 2, "logprobs": 2}).encode(),
    )
    assert (
        status == 400
        and "logprobs is not supported with use_beam_search" in json.loads(raw)["error"]["message"]
    )


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_a_cancelled_beam_request_frees_its_blocks_and_rows(model_dirs, arch) -> None:
    server = ServerThread(model_dirs(arch), kv_block_size=4, served_model_name="tiny")
    try:
        started = threading.Event()
        name = "step" if arch == "llama" else "decode"  # the paged engine's step, the padded one's
        step = getattr(server.engine, name)

        def slow_step(batch):
            started.set()
            threading.Event().wait(0.05)
            return step(batch)

        setattr(server.engine, name, slow_step)
        body = {"prompt": "Hello", "max_tokens": 200, "n": 4, "use_beam_search": True, "min_tokens": 200}
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.server.http_port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            urllib.request.urlopen(request, timeout=1.0)
        assert started.is_set()
        wait_until(lambda: server.kv_blocks().admitted == 0, "the cancelled beam request leaves", 30)
        assert metric(server, "tgi_request_failure_total") == 1  # cancelled, not finished
        assert not server.kv_blocks().blocks_used  # paged: no block held (padded: no pool)
        assert set(server.loop.runner.tracked().values()) == {0}
    finally:
        server.stop()


# ---- bad words ----------------------------------------------------------------------------------------


def banned_word(model_dir: Path, ids: Sequence[int]) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """A word greedy decoding would produce (a letters-only piece of its output), and its sequences."""
    tokenizer = reference._load(model_dir)[1]
    for token in reference.greedy_ids(reference._load(model_dir)[0], ids, NEW_TOKENS):
        word = tokenizer.decode([token]).strip()
        if word.isalpha():
            encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
            return word, word_sequences([word], encode)
    pytest.skip("greedy decoding produced no letters-only token on this model")


def test_bad_words_are_never_generated_greedy_and_in_beams_as_transformers_bans_them(served) -> None:
    server, model_dir = served
    prompt = "The quick brown fox"
    ids = prompt_ids(model_dir, prompt)
    word, sequences = banned_word(model_dir, ids)
    client = server.openai_client()
    greedy = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"bad_words": [word]}
    )
    model, tokenizer = reference._load(model_dir)
    out, start = reference.generate(
        model, ids, max_new_tokens=NEW_TOKENS, bad_words_ids=[list(s) for s in sequences]
    )
    expected = tokenizer.decode(out[0, start:], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert greedy.choices[0].text == expected.rstrip("\ufffd")
    assert (
        greedy.choices[0].text != reference.greedy(model_dir, prompt, NEW_TOKENS).text
    )  # the ban changed it
    beams = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        n=3,
        extra_body={"use_beam_search": True, "bad_words": [word]},
    )
    assert_same_beams(served_beams(beams.choices), reference_beams(model_dir, ids, 3, bad_words=sequences))


def test_sampled_tokens_never_complete_a_bad_word_on_tgi_rest(served) -> None:
    server, model_dir = served
    prompt = "The quick brown fox"
    word, sequences = banned_word(model_dir, prompt_ids(model_dir, prompt))
    for seed in range(4):
        body = {
            "inputs": prompt,
            "parameters": {"max_new_tokens": 12, "do_sample": True, "temperature": 0.3, "seed": seed,
                           "bad_words": [word], "details": True},
        }  # fmt: skip
        status, _, raw = server.http_post("/generate", json.dumps(body).encode())
        assert status == 200, raw
        tokens = [t["id"] for t in json.loads(raw)["details"]["tokens"]]
        for sequence in sequences:
            n = len(sequence)
            assert all(tuple(tokens[i : i + n]) != sequence for i in range(len(tokens) - n + 1)), (seed, word)
