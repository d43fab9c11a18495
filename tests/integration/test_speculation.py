"""Speculative decoding in the paged step is exact.

Greedy output equals transformers' generate() token for token, unary and streamed, and every other
option keeps its meaning when several tokens are accepted in one step: a seed reproduces the same
tokens, stop sequences, min/max new tokens, token details, guided decoding and adapters all answer
as a server without speculation does.

A tiny random model's output seldom repeats itself, so prompt lookup would rarely have a draft here.
These servers speculate with an oracle instead, wired in where prompt lookup is: it proposes the
model's own greedy continuation with every third token wrong, so steps accept whole drafts, parts of
them and nothing, deterministically. Prompt lookup itself is tested on the demo model, whose output
does repeat (test_demo_speculation.py), and without a model (tests/unit/speculation).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.fixtures.adapters import write_lora, write_raw_prefix
from tests.fixtures.speculator import write_random_speculator
from tests.integration import reference
from tests.integration.harness import ServerThread, metric
from tgis.pb import generation_pb2 as pb
from tgis.startup import runners

PAGED_ARCHS = ("llama", "gpt2", "gpt_neox")
# Prompts that repeat themselves give prompt lookup something to find from the first token.
PROMPTS = (
    "the cat sat on the mat, the cat sat on the",
    "one two three four five one two three four five one two",
    "Hello world",
)
NEW_TOKENS = 24


def params(**fields) -> pb.Parameters:
    stopping = fields.pop("stopping", pb.StoppingCriteria(max_new_tokens=NEW_TOKENS))
    return pb.Parameters(stopping=stopping, **fields)


def generate(server: ServerThread, text: str, parameters: pb.Parameters, **request) -> pb.GenerationResponse:
    message = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=text)], params=parameters, **request
    )
    (answer,) = server.stub.Generate(message, timeout=60).responses
    return answer


def stream(server: ServerThread, text: str, parameters: pb.Parameters) -> list[pb.GenerationResponse]:
    message = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=parameters)
    return list(server.stub.GenerateStream(message, timeout=60))


def assert_same_answer(got: pb.GenerationResponse, want: pb.GenerationResponse) -> None:
    """Equal, but for logprobs: a draft's positions are scored by a several-token forward, whose float
    rounding differs from a one-token decode's in the last digits."""
    for field in (
        "text",
        "generated_token_count",
        "stop_reason",
        "stop_sequence",
        "seed",
        "input_token_count",
    ):
        assert getattr(got, field) == getattr(want, field), field
    for kind in ("tokens", "input_tokens"):
        mine, theirs = getattr(got, kind), getattr(want, kind)
        assert [(t.text, t.rank) for t in mine] == [(t.text, t.rank) for t in theirs], kind
        assert [[top.text for top in t.top_tokens] for t in mine] == [
            [top.text for top in t.top_tokens] for t in theirs
        ]
        for a, b in zip(mine, theirs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4, nan_ok=True)
            assert [x.logprob for x in a.top_tokens] == pytest.approx(
                [x.logprob for x in b.top_tokens], abs=1e-4
            )


class OracleProposer:
    """Proposes the model's greedy continuation of each sequence (from transformers), every third
    token of it wrong."""

    wants_hidden = False

    def __init__(self, model_dir: Path) -> None:
        self.model = reference._load(model_dir)[0]
        self.tokens: dict[int, list[int]] = {}

    def start(self, task_id: int, prompt) -> None:
        self.tokens[task_id] = list(prompt)

    def extend(self, task_id: int, tokens, hidden=None) -> None:
        self.tokens[task_id] += tokens

    def stop(self, task_id: int) -> None:
        self.tokens.pop(task_id, None)

    def propose(self, task_ids, count: int) -> dict[int, tuple[int, ...]]:
        drafts = {}
        for task_id in task_ids:
            sequence = self.tokens[task_id]
            draft = list(reference.greedy_ids(self.model, sequence, count))
            wrong = len(sequence) % 3
            if wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % self.model.config.vocab_size
            drafts[task_id] = tuple(draft)
        return drafts


@pytest.fixture(scope="module", params=PAGED_ARCHS)
def servers(request, model_dirs, tmp_path_factory) -> Iterator[tuple[ServerThread, ServerThread, Path]]:
    """A server speculating (with the oracle) and one that does not, on the same model and store."""
    arch = request.param
    model_dir = model_dirs(arch)
    store = tmp_path_factory.mktemp(f"spec-store-{arch}")
    config = json.loads((model_dir / "config.json").read_text())
    hidden = config.get("hidden_size") or config.get("n_embd")
    write_raw_prefix(
        store, "prefix", decoder=torch.randn(3, hidden, generator=torch.Generator().manual_seed(5))
    )
    write_lora(store, "lora", model_dir, seed=3)
    common = {"prefix_store_path": str(store), "max_batch_size": 8}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runners, "NgramProposer", lambda: OracleProposer(model_dir))
        speculating = ServerThread(model_dir, speculator_name="ngram", speculator_tokens=5, **common)
    plain = ServerThread(model_dir, **common)
    try:
        yield speculating, plain, model_dir
    finally:
        speculating.stop()
        plain.stop()


def test_greedy_output_equals_transformers_unary_and_streamed(servers) -> None:
    speculating, _, model_dir = servers
    before = metric(speculating, "tgi_speculation_accepted_tokens_total")
    for prompt in PROMPTS:
        expected = reference.greedy(model_dir, prompt, NEW_TOKENS)
        answer = generate(speculating, prompt, params())
        assert (answer.text, answer.generated_token_count) == (expected.text, expected.generated_token_count)
        assert pb.StopReason.Name(answer.stop_reason) == expected.stop_reason
        messages = stream(speculating, prompt, params())
        assert "".join(m.text for m in messages) == expected.text
        assert messages[-1].generated_token_count == expected.generated_token_count
    assert metric(speculating, "tgi_speculation_accepted_tokens_total") > before, (
        "no draft token was ever accepted"
    )


def test_a_stream_sends_each_accepted_token_as_its_own_message(servers) -> None:
    """TGIS streams a step that accepts several tokens as consecutive messages, one per token."""
    speculating, _, _ = servers
    details = pb.ResponseOptions(generated_tokens=True)
    messages = stream(speculating, PROMPTS[1], params(response=details))
    counts = [m.generated_token_count for m in messages[1:]]
    assert counts == list(range(1, len(counts) + 1))
    assert all(len(m.tokens) == 1 for m in messages[1:])


OPTIONS = {
    "seeded sampling": params(
        method=pb.SAMPLE, sampling=pb.SamplingParameters(seed=7, temperature=0.8, top_k=20, top_p=0.9)
    ),
    "stop sequence": params(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, stop_sequences=["the"])),
    "min and max tokens": params(stopping=pb.StoppingCriteria(max_new_tokens=9, min_new_tokens=9)),
    "time limit": params(stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, time_limit_millis=60_000)),
    "penalties": params(decoding=pb.DecodingParameters(repetition_penalty=1.5)),
    "token details": params(
        response=pb.ResponseOptions(
            generated_tokens=True, token_logprobs=True, token_ranks=True, top_n_tokens=3, input_tokens=True
        )
    ),
    "guided regex": params(decoding=pb.DecodingParameters(regex="(the |cat |sat )+on")),
    "guided choice": params(
        decoding=pb.DecodingParameters(
            choice=pb.DecodingParameters.StringChoices(choices=["the cat", "the mat"])
        )
    ),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_option_answers_as_without_speculation(servers, option) -> None:
    speculating, plain, _ = servers
    for prompt in PROMPTS:
        want = generate(plain, prompt, OPTIONS[option])
        got = generate(speculating, prompt, OPTIONS[option])
        assert_same_answer(got, want)


@pytest.mark.parametrize("adapter", ["prefix", "lora"])
def test_adapters_answer_as_without_speculation(servers, adapter) -> None:
    speculating, plain, _ = servers
    for prompt in PROMPTS:
        want = generate(plain, prompt, params(), adapter_id=adapter)
        got = generate(speculating, prompt, params(), adapter_id=adapter)
        assert_same_answer(got, want)


def test_concurrent_requests_speculate_side_by_side_exactly(servers) -> None:
    from concurrent.futures import ThreadPoolExecutor

    speculating, plain, _ = servers
    prompts = list(PROMPTS) * 3
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: generate(speculating, p, params()), prompts))
    for prompt, answer in zip(prompts, got, strict=True):
        assert_same_answer(answer, generate(plain, prompt, params()))


def test_a_stop_sequence_inside_an_accepted_run_ends_the_output_there(servers) -> None:
    speculating, plain, _ = servers
    for prompt in PROMPTS:
        full = generate(plain, prompt, params())
        stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]  # somewhere mid-output
        for include in (True, False):
            stopping = pb.StoppingCriteria(
                max_new_tokens=NEW_TOKENS, stop_sequences=[stop], include_stop_sequence=include
            )
            want = generate(plain, prompt, params(stopping=stopping))
            assert pb.StopReason.Name(want.stop_reason) == "STOP_SEQUENCE"
            assert_same_answer(generate(speculating, prompt, params(stopping=stopping)), want)


# ---- TGIS's MLP speculator, fed the model's last hidden state ---------------------------------------


@pytest.fixture(scope="module", params=PAGED_ARCHS)
def mlp_server(request, model_dirs, tmp_path_factory) -> Iterator[tuple[ServerThread, ServerThread, Path]]:
    """A server speculating with a random MLP speculator in the public checkpoints' format."""
    model_dir = model_dirs(request.param)
    directory = write_random_speculator(tmp_path_factory.mktemp("mlp"), model_dir)
    speculating = ServerThread(model_dir, speculator_name=str(directory), speculator_max_batch_size=8)
    plain = ServerThread(model_dir)
    try:
        yield speculating, plain, model_dir
    finally:
        speculating.stop()
        plain.stop()


def test_an_mlp_speculator_proposes_and_greedy_output_still_equals_transformers(mlp_server) -> None:
    speculating, plain, model_dir = mlp_server
    for prompt in PROMPTS:
        expected = reference.greedy(model_dir, prompt, NEW_TOKENS)
        answer = generate(speculating, prompt, params())
        assert (answer.text, answer.generated_token_count) == (expected.text, expected.generated_token_count)
        assert "".join(m.text for m in stream(speculating, prompt, params())) == expected.text
        seeded = OPTIONS["seeded sampling"]
        assert_same_answer(generate(speculating, prompt, seeded), generate(plain, prompt, seeded))
    assert metric(speculating, "tgi_speculation_proposed_tokens_total") > 0


# ---- the same on a CUDA device ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_speculation_on_cuda_equals_transformers_generate(model_dirs, tmp_path, arch) -> None:
    """The oracle's drafts (whole, partial and rejected) and an MLP speculator's, verified by the CUDA
    paged step in float32, leave greedy output as transformers' generate() gives it, concurrently too."""
    model_dir = model_dirs(arch)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runners, "NgramProposer", lambda: OracleProposer(model_dir))
        oracle = ServerThread(model_dir, speculator_name="ngram", speculator_tokens=5, dtype="float32")
    mlp = ServerThread(
        model_dir, speculator_name=str(write_random_speculator(tmp_path, model_dir)), dtype="float32"
    )
    try:
        for server in (oracle, mlp):
            assert server.engine.spec.device.type == "cuda"
            for prompt in PROMPTS:
                expected = reference.greedy(model_dir, prompt, NEW_TOKENS)
                assert generate(server, prompt, params()).text == expected.text, prompt
                assert "".join(m.text for m in stream(server, prompt, params())) == expected.text, prompt
        assert metric(oracle, "tgi_speculation_accepted_tokens_total") > 0
        assert metric(mlp, "tgi_speculation_proposed_tokens_total") > 0
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda text: generate(oracle, text, params()), PROMPTS))
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            assert answer.text == reference.greedy(model_dir, prompt, NEW_TOKENS).text, prompt
    finally:
        oracle.stop()
        mlp.stop()
