"""One suite for every engine: each must answer like transformers whichever DEPLOYMENT_FRAMEWORK runs it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engines.base import Engine, PrefillRow
from tests.engines.conftest import ENGINE_ARCHS
from tests.engines.driver import Run, prompt_ids, reference_greedy, reference_logprobs, reference_model
from tests.integration import reference
from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb

PROMPTS = (
    "Hello world",
    "The quick brown fox 🦊 jumps over",
    "日本語のテキストと中文",
    "naïve café — ünïcode 👍🏽 and more text to make this one the longest prompt of all",
)
LOGPROB_TOLERANCE = 1e-4

CASES = [
    pytest.param(engine, arch, id=f"{engine}-{arch}")
    for engine, archs in ENGINE_ARCHS.items()
    for arch in archs
]
# Through the server: the baseline engine is covered by tests/integration.
SERVER_CASES = [case for case in CASES if case.values[0] != "hf_transformers"]


@pytest.fixture
def driven(suite_engine: Callable[[str, str], Engine]) -> Iterator[Callable[[str, str], Engine]]:
    """The engine for a case, checked empty before and emptied after the test drives it."""
    used: list[Engine] = []

    def get(engine: str, arch: str) -> Engine:
        used.append(suite_engine(engine, arch))
        assert used[-1].num_rows == 0
        return used[-1]

    yield get
    for engine in used:
        engine.clear()


def eos_ids(engine: Engine) -> frozenset[int]:
    return frozenset(engine.spec.eos_token_ids)


# ---- the engine object directly -----------------------------------------------------------------------


@pytest.mark.parametrize(("engine_name", "arch"), CASES)
def test_batched_greedy_equals_transformers_generate(driven, engine_model_dir, engine_name, arch):
    engine = driven(engine_name, arch)
    model_dir = engine_model_dir(engine_name, arch)
    prompts = {text: prompt_ids(model_dir, text) for text in PROMPTS}
    run = Run(engine, eos_ids(engine))
    run.join(prompts)
    run.finish()
    for text, ids in prompts.items():
        assert tuple(run.tokens[text]) == reference_greedy(model_dir, ids), text
    assert engine.num_rows == 0


@pytest.mark.parametrize(("engine_name", "arch"), CASES)
def test_rows_joining_and_leaving_mid_run_keep_their_solo_answers(
    driven, engine_model_dir, engine_name, arch
):
    engine = driven(engine_name, arch)
    model_dir = engine_model_dir(engine_name, arch)
    ids = {name: prompt_ids(model_dir, text) for name, text in zip("abcd", PROMPTS, strict=True)}
    run = Run(engine, eos_ids(engine))
    run.join({"a": ids["a"]})
    for _ in range(3):
        run.step()
    run.join({"b": ids["b"], "c": ids["c"]})  # longer prompts join a shorter running cache
    run.step()
    run.leave(["a"])  # a cancelled row leaves from the front, unfinished
    run.join({"d": ids["d"]})
    run.finish()
    assert tuple(run.tokens["a"]) == reference_greedy(model_dir, ids["a"])[: len(run.tokens["a"])]
    for name in "bcd":
        assert tuple(run.tokens[name]) == reference_greedy(model_dir, ids[name]), name


@pytest.mark.parametrize(("engine_name", "arch"), CASES)
def test_a_row_named_twice_by_keep_rows_is_copied_with_its_cache(driven, engine_model_dir, engine_name, arch):
    # Beam search lays the batch out again each step: rows dropped, reordered and copied.
    engine = driven(engine_name, arch)
    model_dir = engine_model_dir(engine_name, arch)
    first, second = prompt_ids(model_dir, PROMPTS[0]), prompt_ids(model_dir, PROMPTS[1])
    engine.prefill([PrefillRow(first), PrefillRow(second)])
    engine.keep_rows([1, 0, 1])
    tokens = [40, 50, 60]
    logits = engine.decode(tokens)
    for row, (ids, token) in enumerate(zip((second, first, second), tokens, strict=True)):
        expected = reference_logprobs(model_dir, ids, [token, 0])  # the position after `token`
        got = torch.log_softmax(logits[row], dim=-1)[0]
        torch.testing.assert_close(got, expected[1], atol=LOGPROB_TOLERANCE, rtol=0)
    assert engine.num_rows == 3


@pytest.mark.parametrize(("engine_name", "arch"), CASES)
def test_token_logprobs_are_within_tolerance_of_transformers(driven, engine_model_dir, engine_name, arch):
    engine = driven(engine_name, arch)
    model_dir = engine_model_dir(engine_name, arch)
    prompts = {text: prompt_ids(model_dir, text) for text in PROMPTS[:3]}
    run = Run(engine, eos_ids(engine))
    run.join(prompts)
    run.finish()
    for text, ids in prompts.items():
        expected = reference_logprobs(model_dir, ids, run.tokens[text])
        torch.testing.assert_close(torch.tensor(run.logprobs[text]), expected, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize(("engine_name", "arch"), [case for case in CASES if case.values[1] != "t5"])
def test_prompt_logits_equal_transformers_for_each_prompt_position(
    driven, engine_model_dir, engine_name, arch
):
    engine = driven(engine_name, arch)
    model_dir = engine_model_dir(engine_name, arch)
    short, long = prompt_ids(model_dir, PROMPTS[0]), prompt_ids(model_dir, PROMPTS[3])
    result = engine.prefill([PrefillRow(short, want_prompt_logits=True), PrefillRow(long)])
    assert result.prompt_logits[1] is None
    got = result.prompt_logits[0]
    assert got is not None
    with torch.inference_mode():
        expected = reference_model(model_dir)(input_ids=torch.tensor([short])).logits[0].float()
    torch.testing.assert_close(got, expected, atol=LOGPROB_TOLERANCE, rtol=0)


# ---- through the real server ----------------------------------------------------------------------------


def greedy_params(max_new_tokens: int) -> pb.Parameters:
    return pb.Parameters(method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens))


def unary(server: ServerThread, text: str, params: pb.Parameters) -> pb.GenerationResponse:
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)], params=params)
    return server.stub.Generate(request, timeout=120).responses[0]


def streamed(server: ServerThread, text: str, params: pb.Parameters) -> pb.GenerationResponse:
    """The stream folded into one response: texts and token details concatenated, the rest from the end."""
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=params)
    messages = list(server.stub.GenerateStream(request, timeout=120))
    folded = pb.GenerationResponse()
    folded.CopyFrom(messages[-1])
    folded.text = "".join(m.text for m in messages)
    folded.input_token_count = messages[0].input_token_count
    del folded.tokens[:]
    for message in messages:
        folded.tokens.extend(message.tokens)
    return folded


@pytest.mark.parametrize(("engine_name", "arch"), SERVER_CASES)
def test_server_answers_equal_transformers_unary_and_streamed_under_concurrent_load(
    suite_server, engine_model_dir, engine_name, arch
):
    server = suite_server(engine_name, arch)
    model_dir = engine_model_dir(engine_name, arch)
    cases = [(PROMPTS[i % len(PROMPTS)], 4 + 3 * i, i % 2 == 1) for i in range(8)]

    def call(case: tuple[str, int, bool]) -> pb.GenerationResponse:
        text, new_tokens, stream = case
        return (streamed if stream else unary)(server, text, greedy_params(new_tokens))

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(call, cases))
    for (text, new_tokens, stream), answer in zip(cases, answers, strict=True):
        expected = reference.greedy(model_dir, text, new_tokens)
        where = f"{text!r} streamed={stream}"
        assert answer.text == expected.text, where
        assert answer.generated_token_count == expected.generated_token_count, where
        assert pb.StopReason.Name(answer.stop_reason) == expected.stop_reason, where
        assert answer.input_token_count == expected.input_token_count, where


@pytest.mark.parametrize(("engine_name", "arch"), SERVER_CASES)
def test_seeded_sampling_is_reproducible_and_matches_the_baseline_engine(suite_server, engine_name, arch):
    server = suite_server(engine_name, arch)
    baseline = suite_server("hf_transformers", arch)
    params = pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.8, top_k=40, seed=1234),
        stopping=pb.StoppingCriteria(max_new_tokens=10),
        response=pb.ResponseOptions(generated_tokens=True, token_logprobs=True),
    )
    first = unary(server, PROMPTS[1], params)
    again = streamed(server, PROMPTS[1], params)
    expected = unary(baseline, PROMPTS[1], params)
    assert first.seed == again.seed == expected.seed == 1234
    for answer in (first, again):
        assert answer.text == expected.text
        assert [t.text for t in answer.tokens] == [t.text for t in expected.tokens]
        got = torch.tensor([t.logprob for t in answer.tokens])
        want = torch.tensor([t.logprob for t in expected.tokens])
        torch.testing.assert_close(got, want, atol=LOGPROB_TOLERANCE, rtol=0)
