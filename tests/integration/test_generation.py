"""Generate / GenerateStream through the real gRPC server against transformers' generate()."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.fixtures.tiny import ARCHS
from tests.integration import reference
from tests.integration.harness import ServerThread, wait_until
from tgis.pb import generation_pb2 as pb

PROMPTS = [
    "Hello world",
    "The quick brown fox 🦊 jumps over",
    "日本語のテキストと中文",
    "naïve café — ünïcode 👍🏽 and more text to make this one the longest prompt of all",
]


def greedy_params(max_new_tokens: int) -> pb.Parameters:
    return pb.Parameters(method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens))


def assert_matches(response: pb.GenerationResponse, expected: reference.Expected) -> None:
    assert response.text == expected.text
    assert response.generated_token_count == expected.generated_token_count
    assert pb.StopReason.Name(response.stop_reason) == expected.stop_reason
    assert response.input_token_count == expected.input_token_count


def stream(server: ServerThread, text: str, params: pb.Parameters) -> list[pb.GenerationResponse]:
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text=text), params=params)
    return list(server.stub.GenerateStream(request, timeout=60))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_unary_greedy_equals_transformers_generate(server_for, model_dirs, arch):
    server = server_for(arch)
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=t) for t in PROMPTS], params=greedy_params(16)
    )
    answer = server.stub.Generate(request, timeout=60)
    assert len(answer.responses) == len(PROMPTS)
    for prompt, response in zip(PROMPTS, answer.responses, strict=True):
        assert_matches(response, reference.greedy(model_dirs(arch), prompt, 16))
        assert response.seed == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_concatenation_equals_unary_answer(server_for, arch):
    server = server_for(arch)
    params = greedy_params(24)
    for prompt in PROMPTS:
        unary = server.stub.Generate(
            pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=prompt)], params=params),
            timeout=60,
        ).responses[0]
        messages = stream(server, prompt, params)
        first, rest = messages[0], messages[1:]
        assert first.input_token_count == unary.input_token_count
        assert first.generated_token_count == 0 and first.stop_reason == pb.NOT_FINISHED
        assert all(m.input_token_count == 0 for m in rest)
        assert "".join(m.text for m in rest) == unary.text
        assert rest[-1].generated_token_count == unary.generated_token_count
        assert rest[-1].stop_reason == unary.stop_reason
        assert all(m.stop_reason == pb.NOT_FINISHED for m in rest[:-1])


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_concurrent_requests_of_different_lengths_each_get_their_solo_result(server_for, model_dirs, arch):
    server = server_for(arch)
    cases = [(f"{PROMPTS[i % len(PROMPTS)]} {'more ' * i}", 4 + 3 * i) for i in range(12)]

    def run(case: tuple[str, int]) -> pb.GenerationResponse:
        text, max_new = case
        if len(text) % 2:  # mix unary and streamed callers in the same batch
            messages = stream(server, text, greedy_params(max_new))
            return pb.GenerationResponse(
                text="".join(m.text for m in messages[1:]),
                input_token_count=messages[0].input_token_count,
                generated_token_count=messages[-1].generated_token_count,
                stop_reason=messages[-1].stop_reason,
            )
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=text)], params=greedy_params(max_new)
        )
        return server.stub.Generate(request, timeout=60).responses[0]

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(run, cases))
    for (text, max_new), answer in zip(cases, answers, strict=True):
        assert_matches(answer, reference.greedy(model_dirs(arch), text, max_new))


def sampling_params(seed: int | None, **sampling) -> pb.Parameters:
    sampling_message = pb.SamplingParameters(**sampling)
    if seed is not None:
        sampling_message.seed = seed
    return pb.Parameters(
        method=pb.SAMPLE, sampling=sampling_message, stopping=pb.StoppingCriteria(max_new_tokens=20)
    )


def test_seeded_sampling_is_reproducible_across_calls_and_batch_compositions(server_for):
    server = server_for("gpt2")
    params = sampling_params(1234, temperature=1.5, top_k=50, top_p=0.95)
    alone = server.stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPTS[1])], params=params),
        timeout=60,
    ).responses[0]
    again = server.stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPTS[1])], params=params),
        timeout=60,
    ).responses[0]
    in_batch = server.stub.Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=t) for t in PROMPTS], params=params),
        timeout=60,
    ).responses[1]
    streamed = stream(server, PROMPTS[1], params)
    assert alone.seed == again.seed == in_batch.seed == 1234
    assert alone.text == again.text == in_batch.text == "".join(m.text for m in streamed[1:])
    assert streamed[0].seed == streamed[-1].seed == 1234
    greedy = server.stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=PROMPTS[1])], params=greedy_params(20)
        ),
        timeout=60,
    ).responses[0]
    other_seed = server.stub.Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=PROMPTS[1])], params=sampling_params(99, temperature=1.5)
        ),
        timeout=60,
    ).responses[0]
    assert alone.text != greedy.text or alone.text != other_seed.text


def test_unseeded_sampling_gives_each_identical_input_its_own_32_bit_seed(server_for):
    server = server_for("gpt2")
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text=PROMPTS[0])] * 5, params=sampling_params(None, temperature=2.0)
    )
    answers = server.stub.Generate(request, timeout=60).responses
    seeds = {a.seed for a in answers}
    assert len(seeds) == 5 and all(0 <= s < 2**32 for s in seeds)
    assert len({a.text for a in answers}) == 5


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "padded"])
def test_cancelled_stream_frees_its_batch_slot_while_others_finish(model_dirs, paged):
    server = ServerThread(model_dirs("llama"), paged_attention=paged)
    engine = server.engine
    assert engine.spec.paged is paged
    step_method = "step" if paged else "decode"
    real_step = getattr(engine, step_method)
    steps = threading.Semaphore(0)

    def paced_step(batch):  # the test releases steps one by one so the cancel lands mid-stream
        assert steps.acquire(timeout=30)
        return real_step(batch)

    setattr(engine, step_method, paced_step)
    try:
        long_call = server.stub.GenerateStream(
            pb.SingleGenerationRequest(
                request=pb.GenerationRequest(text=PROMPTS[0]), params=greedy_params(200)
            ),
            timeout=60,
        )
        next(long_call)  # first message: input count
        short = server.stub.Generate.future(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=PROMPTS[2])], params=greedy_params(8)
            ),
            timeout=60,
        )

        def step_until(predicate, what: str) -> None:
            def poll() -> bool:
                if predicate():
                    return True
                steps.release()
                return False

            wait_until(poll, what)

        step_until(lambda: server.loop.admitted_count == 2, "both requests run")
        load = server.loop.load()
        assert (load.running, load.waiting) == (2, 0)
        assert 0 < load.kv_cache_usage <= 1
        long_call.cancel()
        cancelled = server.metrics.request_failure.labels(err="cancelled")
        step_until(lambda: cancelled._value.get() == 1, "the cancelled stream is dropped")
        step_until(short.done, "the other request finishes")
        assert server.loop.admitted_count == 0
        assert server.metrics.batch_current_size._value.get() == 0
        assert server.loop.load().kv_cache_usage == 0
        if paged:  # every block is back in the pool (cached prefixes stay, unreferenced)
            assert server.kv_blocks().blocks_used == 0
        expected = reference.greedy(model_dirs("llama"), PROMPTS[2], 8)
        assert_matches(short.result().responses[0], expected)
        with pytest.raises(grpc.RpcError) as error:
            list(long_call)
        assert error.value.code() == grpc.StatusCode.CANCELLED
    finally:
        setattr(engine, step_method, real_step)
        for _ in range(1000):
            steps.release()
        server.stop()
