"""The paged step through the real server: chunked prefill, prefix caching, block accounting, fallbacks."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from tests.integration import reference
from tests.integration.harness import ServerThread, metric
from tests.integration.test_generation import PROMPTS, assert_matches, greedy_params
from tgis.config import StartupError
from tgis.pb import generation_pb2 as pb
from tgis.startup import kv_pool

# A system prompt several blocks long that every request shares, as chat and RAG templates do.
SHARED = "You are a helpful assistant. Answer briefly and politely, in plain words. " * 2


def generate(server: ServerThread, text: str, params: pb.Parameters) -> pb.GenerationResponse:
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)], params=params)
    return server.stub.Generate(request, timeout=120).responses[0]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_prompts_chunked_over_many_steps_equal_transformers_generate(model_dirs, arch):
    # 5 tokens per step: every prompt is spread over several steps, beside running decodes.
    server = ServerThread(model_dirs(arch), max_step_tokens=5, kv_block_size=4)
    try:
        assert server.engine.spec.paged
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda text: generate(server, text, greedy_params(12)), PROMPTS))
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            assert_matches(answer, reference.greedy(model_dirs(arch), prompt, 12))
        assert metric(server, "tgi_batch_inference_count_total") > len(PROMPTS)
        assert server.kv_blocks().blocks_used == 0
    finally:
        server.stop()


def test_a_shared_prefix_is_served_from_the_cache_with_identical_output(model_dirs):
    server = ServerThread(model_dirs("llama"), kv_block_size=4)
    try:
        questions = [SHARED + "What is 2+2?", SHARED + "Name a colour."]
        first = [generate(server, q, greedy_params(10)) for q in questions]
        assert metric(server, "tgi_prefix_cache_hits_total") > 0  # the second reused the first's blocks
        hits = metric(server, "tgi_prefix_cache_hits_total")
        again = [generate(server, q, greedy_params(10)) for q in questions]  # whole prompts cached now
        assert metric(server, "tgi_prefix_cache_hits_total") > hits
        for question, cold, warm in zip(questions, first, again, strict=True):
            expected = reference.greedy(model_dirs("llama"), question, 10)
            assert_matches(cold, expected)
            assert_matches(warm, expected)
        assert metric(server, "tgi_prefix_cache_queries_total") >= metric(
            server, "tgi_prefix_cache_hits_total"
        )
        usage = server.kv_blocks()
        assert usage.blocks_used == 0 and usage.blocks_cached > 0
    finally:
        server.stop()


def test_decodes_sharing_cached_blocks_attend_them_in_one_pass_with_identical_output(model_dirs, monkeypatch):
    from engines.paged import attention, step_inputs

    monkeypatch.setattr(step_inputs, "SHARED_PREFIX_MIN_WORK", 0)  # split off however short the prefix
    splits: list[int] = []
    shared_pass = attention._shared_prefix_attention

    def counted(*args):
        splits.append(len(args[0]))
        return shared_pass(*args)

    monkeypatch.setattr(attention, "_shared_prefix_attention", counted)
    server = ServerThread(model_dirs("llama"), kv_block_size=4)
    try:
        questions = [SHARED + q for q in ("What is 2+2?", "Name a colour.", "Say hi.", "Count to 3.")]
        generate(server, questions[0], greedy_params(2))  # caches the shared prefix's blocks
        with ThreadPoolExecutor(len(questions)) as pool:
            answers = list(pool.map(lambda q: generate(server, q, greedy_params(10)), questions))
        assert splits, "the decodes never attended their shared prefix in one pass"
        for question, answer in zip(questions, answers, strict=True):
            assert_matches(answer, reference.greedy(model_dirs("llama"), question, 10))
    finally:
        server.stop()


def test_without_prefix_caching_nothing_is_reused(model_dirs):
    server = ServerThread(model_dirs("llama"), kv_block_size=4, prefix_caching=False)
    try:
        for _ in range(2):
            generate(server, SHARED + "Hi", greedy_params(4))
        assert metric(server, "tgi_prefix_cache_hits_total") == 0
        assert server.kv_blocks().blocks_cached == 0
    finally:
        server.stop()


def test_input_token_details_over_chunks_equal_the_padded_engine(model_dirs):
    params = pb.Parameters(
        method=pb.GREEDY,
        stopping=pb.StoppingCriteria(max_new_tokens=4),
        response=pb.ResponseOptions(
            input_tokens=True, generated_tokens=True, token_logprobs=True, token_ranks=True, top_n_tokens=2
        ),
    )
    answers = {}
    for paged in (True, False):
        server = ServerThread(model_dirs("gpt2"), paged_attention=paged, max_step_tokens=3, kv_block_size=4)
        try:
            generate(server, PROMPTS[3], greedy_params(2))  # fills the prefix cache (paged)
            answers[paged] = generate(server, PROMPTS[3], params)
        finally:
            server.stop()
    paged, padded = answers[True], answers[False]
    assert paged.text == padded.text
    assert len(paged.input_tokens) == len(padded.input_tokens) == paged.input_token_count
    for a, b in zip(
        [*paged.input_tokens, *paged.tokens], [*padded.input_tokens, *padded.tokens], strict=True
    ):
        assert (a.text, a.rank) == (b.text, b.rank)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4, nan_ok=True)
        assert [t.text for t in a.top_tokens] == [t.text for t in b.top_tokens]


def test_kv_cache_manager_num_gpu_blocks_sizes_the_pool_and_bounds_admission(model_dirs):
    # 20 blocks of 4 positions, 1 kept for the health probe: admission reserves up to 76 positions,
    # so requests of up to 62 (prompt + 20 new) mostly wait for each other.
    server = ServerThread(
        model_dirs("llama"), kv_cache_manager_num_gpu_blocks=20, kv_block_size=4, max_sequence_length=64
    )
    try:
        assert server.kv_blocks().blocks_total == 20
        with ThreadPoolExecutor(4) as executor:
            answers = list(executor.map(lambda t: generate(server, t, greedy_params(20)), PROMPTS))
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            assert_matches(answer, reference.greedy(model_dirs("llama"), prompt, 20))
        assert server.kv_blocks().blocks_used == 0
    finally:
        server.stop()


def test_a_pool_too_small_for_one_max_length_request_fails_at_start(model_dirs):
    with pytest.raises(StartupError, match="exceeds the estimated capacity"):
        ServerThread(model_dirs("llama"), kv_cache_manager_num_gpu_blocks=4, kv_block_size=4)


def test_models_outside_the_attention_interface_keep_padded_batches(model_dirs):
    for arch in ("bloom", "t5"):
        server = ServerThread(model_dirs(arch))
        try:
            assert not server.engine.spec.paged
            assert_matches(
                generate(server, PROMPTS[1], greedy_params(6)),
                reference.greedy(model_dirs(arch), PROMPTS[1], 6),
            )
        finally:
            server.stop()


def test_paged_attention_required_on_a_model_that_cannot_run_it_fails_at_start(model_dirs):
    with pytest.raises(ValueError, match=r"The paged step .* cannot serve: bloom does not route attention"):
        ServerThread(model_dirs("bloom"), paged_attention=True)


def test_a_failing_step_with_new_prompts_fails_only_those_and_running_streams_go_on(model_dirs):
    server = ServerThread(model_dirs("llama"))
    engine = server.engine
    real_step = engine.step
    armed = threading.Event()

    def step(batch):
        if armed.is_set() and batch.prefill:
            armed.clear()
            raise RuntimeError("injected prompt failure")
        return real_step(batch)

    engine.step = step
    try:
        request = pb.SingleGenerationRequest(
            request=pb.GenerationRequest(text=PROMPTS[0]), params=greedy_params(40)
        )
        running = server.stub.GenerateStream(request, timeout=120)
        next(running)  # the input token count
        first = next(running)
        armed.set()
        with pytest.raises(grpc.RpcError, match="injected prompt failure"):
            generate(server, PROMPTS[1], greedy_params(5))
        text = first.text + "".join(message.text for message in running)
        assert text == reference.greedy(model_dirs("llama"), PROMPTS[0], 40).text
        assert server.kv_blocks().blocks_used == 0
    finally:
        engine.step = real_step
        server.stop()


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_resident_memory_stays_within_the_pool_and_the_stated_step_overhead(model_dirs):
    server = ServerThread(model_dirs("llama"), cpu_memory_budget_mb=400, max_batch_size=32)
    try:
        engine = server.engine
        pool_bytes = engine.num_blocks * engine.kv_shape.bytes_per_block(engine.block_size)
        bound = pool_bytes + kv_pool.step_overhead_bytes(server.settings, engine, server.server.limits)
        assert bound <= 400 * 2**20
        prompt = "The quick brown fox jumps over the lazy dog again and again, " * 6
        params = pb.Parameters(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(seed=7),
            stopping=pb.StoppingCriteria(min_new_tokens=64, max_new_tokens=64),
        )

        def load_round() -> int:
            peak = resident_bytes()
            with ThreadPoolExecutor(32) as pool:
                calls = [pool.submit(generate, server, f"{i} {prompt}", params) for i in range(32)]
                while not all(call.done() for call in calls):
                    peak = max(peak, resident_bytes())
                    time.sleep(0.005)
                assert all(call.result().generated_token_count == 64 for call in calls)
            return peak

        started = resident_bytes()
        first = load_round()
        second = load_round()
        assert first - started <= bound
        assert second - first <= 32 * 2**20  # a second identical round holds no more than the first
        assert server.kv_blocks().blocks_used == 0
    finally:
        server.stop()


def teacher_forced_bf16_agreement(model_dir, prompt: str, tokens: list[str]) -> None:
    """Each generated token is (within bfloat16 rounding) transformers' greedy choice after the server's
    own earlier tokens: its logit is within BF16_TIE of the largest, in transformers' bfloat16 forward
    over the prompt and the server's tokens (EOS left out: min_new_tokens holds it back). Exact equality
    with generate() would fail on near-ties that bfloat16 rounds either way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    model.to("cuda")
    prompt_ids = tokenizer(prompt)["input_ids"]
    generated = tokenizer.convert_tokens_to_ids(tokens)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + generated], device="cuda")
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
        scale = logits.abs().max()
        logits[:, model.config.eos_token_id] = float("-inf")
    chosen = logits.gather(1, torch.tensor(generated, device="cuda")[:, None])[:, 0]
    assert bool((chosen >= logits.max(dim=1).values - BF16_TIE * scale).all()), (prompt, tokens)


BF16_TIE = 0.1  # of the logits' magnitude: twice the engine's bfloat16 self-test tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_paged_step_on_cuda_serves_bfloat16_through_the_fast_path_and_graphs(model_dirs):
    """The defaults on a GPU (block size, CUDA graphs, MAX_BATCH_SIZE 12), in bfloat16: the varlen path
    and decode graphs serve (metrics say so, and graphs were replayed), and the output is transformers'
    greedy choice at bfloat16's precision."""
    server = ServerThread(model_dirs("llama"), max_step_tokens=5, dtype="bfloat16")
    try:
        engine = server.engine
        assert engine.spec.paged and engine.spec.device.type == "cuda"
        assert not torch.backends.cuda.cudnn_sdp_enabled(), "cuDNN attention builds a graph per new shape"
        assert engine.attention_path.startswith("varlen_"), engine.attention_fallback
        assert metric(server, "tgi_cuda_graphs_captured") > 0
        replays = engine.graph_replays
        params = pb.Parameters(
            method=pb.GREEDY,
            stopping=pb.StoppingCriteria(max_new_tokens=12, min_new_tokens=12),
            response=pb.ResponseOptions(generated_tokens=True),
        )
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda text: generate(server, text, params), PROMPTS))
        assert engine.graph_replays > replays
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            teacher_forced_bf16_agreement(model_dirs("llama"), prompt, [t.text for t in answer.tokens])
        labels = {"path": engine.attention_path, "fallback": engine.attention_fallback or ""}
        assert server.metrics.registry.get_sample_value("tgi_attention_path", labels) == 1
    finally:
        server.stop()
