"""Guided decoding over gRPC on tiny random models: every constraint holds by construction.

Random weights produce garbage, so nothing here can pass by luck: JSON outputs must parse and
validate, regex outputs must full-match, choices must be one of the set, over several seeds,
greedy and sampled, unary and streamed, and mixed in one batch with unguided requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch

from tests.fixtures.adapters import write_lora, write_raw_prefix
from tests.fixtures.tiny import HIDDEN
from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,5} [0-9]{3}(-ok|-no)?"
CHOICES = ["red", "green", "blue moon", "çà et là"]
# Small enough that a grammar-only bounded output always completes within MAX_NEW_TOKENS.
MAX_NEW_TOKENS = 120
SEEDS = (0, 1, 2, 7)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", params=[True, False], ids=["paged", "padded"])
def server(request, model_dirs) -> Iterator[ServerThread]:
    server = ServerThread(model_dirs("llama"), paged_attention=request.param, max_new_tokens=512)
    yield server
    server.stop()


def _params(decoding: pb.DecodingParameters, seed: int | None, **stopping) -> pb.Parameters:
    stopping.setdefault("max_new_tokens", MAX_NEW_TOKENS)
    params = pb.Parameters(decoding=decoding, stopping=pb.StoppingCriteria(**stopping))
    if seed is not None:
        params.method = pb.SAMPLE
        params.sampling.CopyFrom(pb.SamplingParameters(seed=seed, top_k=50, top_p=0.95))
    return params


def _generate(server: ServerThread, params: pb.Parameters, texts=(PROMPT,)) -> list[pb.GenerationResponse]:
    request = pb.BatchedGenerationRequest(
        params=params, requests=[pb.GenerationRequest(text=t) for t in texts]
    )
    return list(server.stub.Generate(request, timeout=60).responses)


def _stream(server: ServerThread, params: pb.Parameters) -> tuple[str, list[pb.GenerationResponse]]:
    request = pb.SingleGenerationRequest(params=params, request=pb.GenerationRequest(text=PROMPT))
    messages = list(server.stub.GenerateStream(request, timeout=60))
    return "".join(m.text for m in messages), messages


def _check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _check_any_object(text: str, stop_reason: int = pb.EOS_TOKEN) -> None:
    if stop_reason == pb.EOS_TOKEN:
        assert isinstance(json.loads(text), dict)
    else:  # an object without bounds can outlast max_new_tokens: a cut-off prefix (or it just closed)
        assert stop_reason == pb.MAX_TOKENS and text.startswith("{")
        try:
            assert isinstance(json.loads(text), dict)
        except json.JSONDecodeError as error:
            assert error.msg.startswith(("Unterminated", "Expecting")), error


def _check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def _check_choice(text: str) -> None:
    assert text in CHOICES


CASES = {
    "json_schema": (pb.DecodingParameters(json_schema=json.dumps(SCHEMA)), _check_json),
    "format_json": (pb.DecodingParameters(format=pb.DecodingParameters.JSON), _check_any_object),
    "regex": (pb.DecodingParameters(regex=REGEX), _check_regex),
    "choice": (
        pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices(choices=CHOICES)),
        _check_choice,
    ),
}


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("seed", [None, *SEEDS], ids=lambda s: "greedy" if s is None else f"seed{s}")
def test_constraint_holds_unary_and_streamed(server, kind, seed):
    decoding, check = CASES[kind]
    params = _params(decoding, seed)
    (unary,) = _generate(server, params)
    if kind == "format_json":
        _check_any_object(unary.text, unary.stop_reason)
    else:
        check(unary.text)
        assert unary.stop_reason == pb.EOS_TOKEN
    streamed, messages = _stream(server, params)
    assert streamed == unary.text
    assert messages[-1].stop_reason == unary.stop_reason
    assert messages[-1].generated_token_count == unary.generated_token_count


def test_guided_and_unguided_requests_share_the_batch(server):
    """Concurrent calls of every kind, with plain ones: each keeps its own constraint (or none)."""
    plain = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=30))
    (alone,) = _generate(server, plain)
    jobs = [(kind, _params(CASES[kind][0], seed)) for kind in CASES for seed in SEEDS[:2]]
    jobs += [("plain", plain)] * 4
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _generate(server, job[1])[0], jobs))
    for (kind, _), answer in zip(jobs, answers, strict=True):
        if kind == "plain":
            assert answer.text == alone.text  # greedy, unconstrained: unaffected by the guided rows
        elif kind == "format_json":
            _check_any_object(answer.text, answer.stop_reason)
        else:
            CASES[kind][1](answer.text)


def test_one_call_batches_inputs_under_one_constraint(server):
    answers = _generate(server, _params(CASES["regex"][0], 3), texts=[PROMPT, "Hello", "a b c d"])
    for answer in answers:
        _check_regex(answer.text)


def test_a_constraint_with_one_ending_gives_exactly_that_text(server):
    params = _params(pb.DecodingParameters(regex="tgis says hello, world"), 5)
    (answer,) = _generate(server, params)
    assert answer.text == "tgis says hello, world"
    assert answer.stop_reason == pb.EOS_TOKEN


def test_grammar_in_ebnf(server):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+ | "x"'
    for seed in SEEDS:
        (answer,) = _generate(server, _params(pb.DecodingParameters(grammar=grammar), seed))
        assert re.fullmatch(r"\(([0-9]+|x)(,([0-9]+|x))*\)", answer.text), answer.text


def test_max_new_tokens_still_caps_and_stop_sequences_still_apply(server):
    (capped,) = _generate(server, _params(CASES["json_schema"][0], 1, max_new_tokens=3))
    assert capped.stop_reason == pb.MAX_TOKENS
    assert capped.generated_token_count == 3
    assert capped.text.startswith("{")
    choice = pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices(choices=["abc-def", "abc-xyz"]))
    (stopped,) = _generate(server, _params(choice, 1, stop_sequences=["-"], include_stop_sequence=False))
    assert (stopped.text, stopped.stop_reason) == ("abc", pb.STOP_SEQUENCE)


def test_min_new_tokens_does_not_outlast_the_grammar(server):
    (answer,) = _generate(server, _params(CASES["choice"][0], 2, min_new_tokens=50))
    _check_choice(answer.text)
    assert answer.stop_reason == pb.EOS_TOKEN


def test_token_details_and_repetition_penalty_with_a_constraint(server):
    params = _params(CASES["regex"][0], 4)
    params.decoding.repetition_penalty = 1.5
    params.response.CopyFrom(pb.ResponseOptions(generated_tokens=True, token_logprobs=True, top_n_tokens=2))
    (answer,) = _generate(server, params)
    _check_regex(answer.text)
    assert len(answer.tokens) == answer.generated_token_count
    assert all(t.logprob <= 0 for t in answer.tokens)


@pytest.mark.parametrize(
    ("decoding", "message"),
    [
        (
            pb.DecodingParameters(regex="[a-"),
            "invalid guided decoding regex: Regex parsing error at position 4: Unclosed '['",
        ),
        (
            pb.DecodingParameters(json_schema='{"type": 5}'),
            "invalid guided decoding json_schema: Type should be a string",
        ),
        (
            pb.DecodingParameters(grammar="root ::= foo"),
            "invalid guided decoding grammar: EBNF parser error at line 1, column 10: "
            'Rule "foo" is not defined',
        ),
        (
            pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices()),
            "Must provide at least two choices",
        ),
        (
            pb.DecodingParameters(choice=pb.DecodingParameters.StringChoices(choices=["one"])),
            "Must provide at least two choices",
        ),
    ],
    ids=["regex", "json_schema", "grammar", "no_choices", "one_choice"],
)
def test_invalid_constraints_are_invalid_argument(server, decoding, message):
    params = pb.Parameters(decoding=decoding)
    for call, request in (
        (
            server.stub.Generate,
            pb.BatchedGenerationRequest(params=params, requests=[pb.GenerationRequest(text="x")]),
        ),
        (
            server.stub.GenerateStream,
            pb.SingleGenerationRequest(params=params, request=pb.GenerationRequest(text="x")),
        ),
    ):
        with pytest.raises(grpc.RpcError) as error:
            result = call(request, timeout=30)
            if not isinstance(result, pb.BatchedGenerationResponse):
                list(result)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == message


def test_compiled_grammars_are_cached_with_metrics(server):
    def value(name: str, **labels: str) -> float:
        samples = (s for m in server.metrics.registry.collect() for s in m.samples if s.name == name)
        return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))

    params = _params(pb.DecodingParameters(regex="[a-c]{3}x"), 9)
    misses = value("tgi_guided_grammar_cache_total", result="miss")
    hits = value("tgi_guided_grammar_cache_total", result="hit")
    first = _generate(server, params)[0].text
    assert re.fullmatch("[a-c]{3}x", first)
    assert _generate(server, params)[0].text == first  # same seed, same cached grammar
    assert value("tgi_guided_grammar_cache_total", result="miss") == misses + 1
    assert value("tgi_guided_grammar_cache_total", result="hit") == hits + 1
    assert value("tgi_guided_grammar_cache_size") >= 1
    assert value("tgi_guided_grammar_compile_duration_count") >= 1


def test_format_text_is_no_constraint(server):
    plain = pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=10))
    text = pb.Parameters(
        decoding=pb.DecodingParameters(format=pb.DecodingParameters.TEXT),
        stopping=pb.StoppingCriteria(max_new_tokens=10),
    )
    assert _generate(server, text)[0].text == _generate(server, plain)[0].text


def test_constraints_hold_with_a_prefix_and_a_lora_adapter(model_dirs, tmp_path):
    model_dir = model_dirs("llama")
    write_raw_prefix(
        tmp_path, "prefix", decoder=torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(0))
    )
    write_lora(tmp_path, "lora", model_dir, seed=3)
    server = ServerThread(model_dir, prefix_store_path=str(tmp_path), max_batch_size=8)
    try:
        jobs = [
            (adapter, kind, seed)
            for adapter in ("prefix", "lora", "")
            for kind in CASES
            for seed in (None, 1)
        ]

        def run(job):
            adapter, kind, seed = job
            request = pb.BatchedGenerationRequest(
                adapter_id=adapter,
                params=_params(CASES[kind][0], seed),
                requests=[pb.GenerationRequest(text=PROMPT)],
            )
            return server.stub.Generate(request, timeout=60).responses[0]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(run, jobs))
        for (_, kind, _), answer in zip(jobs, answers, strict=True):
            if kind == "format_json":
                _check_any_object(answer.text, answer.stop_reason)
            else:
                CASES[kind][1](answer.text)
                assert answer.stop_reason == pb.EOS_TOKEN
    finally:
        server.stop()
