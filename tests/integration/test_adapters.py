"""Prompt-tuning prefixes and LoRA adapters through the real gRPC server (SPEC §8, issue 6)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import grpc
import pytest
import torch

from engines.hf_transformers import HFTransformersEngine
from engines.paged.engine import PagedHFEngine
from tests.fixtures.adapters import write_lora, write_peft_prompt_tuning, write_raw_prefix
from tests.integration import reference
from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb

PROMPTS = ("The quick brown fox", "Hello world, this is", "Numbers 1 2 3")
NEW_TOKENS = 6


def _hidden(model_dir: Path) -> int:
    return int(reference._load(model_dir)[0].config.get_text_config().hidden_size)


def _prefix(model_dir: Path, rows: int, seed: int) -> torch.Tensor:
    """Embeddings on the model's own scale, so they steer the output without swamping it."""
    generator = torch.Generator().manual_seed(seed)
    weight = reference._load(model_dir)[0].get_input_embeddings().weight.detach()
    return weight[torch.randint(0, weight.shape[0], (rows,), generator=generator)] + 0.1 * torch.randn(
        rows, weight.shape[1], generator=generator
    )


def _request(text: str, adapter_id: str = "", **params) -> pb.BatchedGenerationRequest:
    return pb.BatchedGenerationRequest(
        adapter_id=adapter_id,
        params=pb.Parameters(
            method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS), **params
        ),
        requests=[pb.GenerationRequest(text=text)],
    )


def _stream_text(server: ServerThread, request: pb.BatchedGenerationRequest) -> tuple[str, int, int]:
    single = pb.SingleGenerationRequest(
        adapter_id=request.adapter_id,
        prefix_id=request.prefix_id,
        params=request.params,
        request=request.requests[0],
    )
    messages = list(server.stub.GenerateStream(single, timeout=120))
    return (
        "".join(m.text for m in messages),
        messages[-1].generated_token_count,
        messages[0].input_token_count,
    )


def _check(server: ServerThread, request: pb.BatchedGenerationRequest, expected: reference.Expected) -> None:
    (answer,) = server.stub.Generate(request, timeout=120).responses
    assert (answer.text, answer.generated_token_count) == (expected.text, expected.generated_token_count)
    assert pb.StopReason.Name(answer.stop_reason) == expected.stop_reason
    assert answer.input_token_count == expected.input_token_count  # the prefix is not counted
    assert _stream_text(server, request) == (
        expected.text,
        expected.generated_token_count,
        expected.input_token_count,
    )


def _concurrently(checks: Sequence[Callable[[], None]]) -> None:
    with ThreadPoolExecutor(len(checks)) as pool:
        for future in [pool.submit(check) for check in checks]:
            future.result()


# ---- prefixes on a decoder-only model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_store(model_dirs, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    model_dir = model_dirs("llama")
    store = tmp_path_factory.mktemp("prefix-store")
    prefixes = {
        "raw": _prefix(model_dir, 4, seed=1),
        "nested/path": _prefix(model_dir, 3, seed=2),
        "peft_safetensors": _prefix(model_dir, 5, seed=3),
        "peft_bin": _prefix(model_dir, 2, seed=4),
    }
    write_raw_prefix(store, "raw", decoder=prefixes["raw"])
    write_raw_prefix(store, "nested/path", decoder=prefixes["nested/path"])
    write_peft_prompt_tuning(store, "peft_safetensors", prefixes["peft_safetensors"], fmt="safetensors")
    write_peft_prompt_tuning(store, "peft_bin", prefixes["peft_bin"], fmt="bin")
    write_raw_prefix(store, "three_d", decoder=torch.zeros(1, 2, _hidden(model_dir)))
    write_raw_prefix(store, "wrong_width", decoder=torch.zeros(2, _hidden(model_dir) + 1))
    write_raw_prefix(store, "not_finite", decoder=torch.full((2, _hidden(model_dir)), math.inf))
    write_raw_prefix(store, "too_long", decoder=torch.zeros(40, _hidden(model_dir)))
    (store / "empty_dir").mkdir()
    return store, prefixes


@pytest.fixture(scope="module")
def llama_server(model_dirs, llama_store) -> Iterator[ServerThread]:
    store, _ = llama_store
    server = ServerThread(
        model_dirs("llama"),
        prefix_store_path=str(store),
        max_sequence_length=64,
        max_new_tokens=32,
        max_prompt_prefix_length=32,
        max_batch_size=8,
    )
    yield server
    server.stop()


def test_prefixes_of_every_layout_match_transformers_with_the_embeddings_prepended(
    llama_server, llama_store, model_dirs
):
    _, prefixes = llama_store
    model_dir = model_dirs("llama")
    checks: list[Callable[[], None]] = []
    for i, (adapter_id, embeddings) in enumerate(prefixes.items()):
        text = PROMPTS[i % len(PROMPTS)]
        expected = reference.greedy_with_prefix(model_dir, text, NEW_TOKENS, decoder=embeddings)
        checks.append(partial(_check, llama_server, _request(text, adapter_id), expected))
    plain = reference.greedy(model_dir, PROMPTS[0], NEW_TOKENS)
    checks.append(lambda: _check(llama_server, _request(PROMPTS[0]), plain))  # no prefix, same batch
    _concurrently(checks)


def test_prefix_id_field_works_like_adapter_id_and_adapter_id_wins(llama_server, llama_store, model_dirs):
    _, prefixes = llama_store
    expected = reference.greedy_with_prefix(
        model_dirs("llama"), PROMPTS[1], NEW_TOKENS, decoder=prefixes["raw"]
    )
    request = _request(PROMPTS[1])
    request.prefix_id = "raw"
    _check(llama_server, request, expected)
    request.adapter_id = "raw"
    request.prefix_id = "does_not_exist"
    (answer,) = llama_server.stub.Generate(request, timeout=120).responses
    assert answer.text == expected.text


def test_input_tokens_include_the_virtual_prefix_positions(llama_server, llama_store, model_dirs):
    _, prefixes = llama_store
    response = pb.ResponseOptions(input_tokens=True, token_logprobs=True)
    (answer,) = llama_server.stub.Generate(
        _request(PROMPTS[2], "raw", response=response), timeout=60
    ).responses
    virtual = prefixes["raw"].shape[0]
    assert len(answer.input_tokens) == virtual + answer.input_token_count
    assert math.isnan(answer.input_tokens[0].logprob)
    pad_text = {t.text for t in answer.input_tokens[:virtual]}
    assert len(pad_text) == 1  # every virtual position reads as the pad token, as in TGIS
    assert all(math.isfinite(t.logprob) for t in answer.input_tokens[1:])


def test_prefix_length_counts_towards_the_sequence_limit(llama_server):
    # 64 max: a 4-row prefix plus 59 input tokens + min 1 does not fit, the message names the prefix.
    text = " ".join(["word"] * 80)
    request = _request(text, "raw", truncate_input_tokens=60)
    with pytest.raises(grpc.RpcError) as raised:
        llama_server.stub.Generate(request, timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "input tokens (60) plus prefix length (4) must be < 64"


@pytest.mark.parametrize(
    ("adapter_id", "reason"),
    [
        ("unknown", 'prefix id "unknown" not found'),
        ("empty_dir", 'prefix id "empty_dir" not found'),
        ("../escape", "Invalid prefix id ../escape, must contain only alphanumeric, _ and - and /"),
        ("three_d", "Invalid prefix embedding tensor"),
        ("wrong_width", "Prefix embedding tensor dim {wrong} does not match model ({hidden})"),
        ("not_finite", "Prefix contains non-finite elements"),
        ("too_long", "Invalid prefix embedding length of 40"),
    ],
)
def test_bad_prefixes_are_invalid_argument_with_the_spec_message(
    llama_server, model_dirs, adapter_id, reason
):
    hidden = _hidden(model_dirs("llama"))
    reason = reason.format(wrong=hidden + 1, hidden=hidden)
    with pytest.raises(grpc.RpcError) as raised:
        llama_server.stub.Generate(_request(PROMPTS[0], adapter_id), timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == f"can't retrieve prompt prefix with id '{adapter_id}': {reason}"


def test_tokenize_checks_the_adapter_id_and_does_not_count_the_prefix(llama_server):
    request = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=PROMPTS[0])], adapter_id="raw")
    plain = pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=PROMPTS[0])])
    assert (
        llama_server.stub.Tokenize(request, timeout=30).responses[0].token_count
        == llama_server.stub.Tokenize(plain, timeout=30).responses[0].token_count
    )
    request.adapter_id = "unknown"
    with pytest.raises(grpc.RpcError) as raised:
        llama_server.stub.Tokenize(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'prefix id "unknown" not found' in raised.value.details()


# ---- prefixes on an encoder-decoder model ------------------------------------------------------------


def test_encoder_decoder_prefixes_match_transformers(model_dirs, tmp_path):
    model_dir = model_dirs("t5")
    hidden = _hidden(model_dir)
    encoder, decoder = _prefix(model_dir, 4, seed=5), _prefix(model_dir, 2, seed=6)
    write_raw_prefix(tmp_path, "enc", decoder=None, encoder=encoder)
    write_raw_prefix(tmp_path, "dec", decoder=decoder)
    write_raw_prefix(tmp_path, "both", decoder=decoder, encoder=encoder)
    write_raw_prefix(tmp_path, "odd", decoder=torch.zeros(3, hidden))
    write_peft_prompt_tuning(tmp_path, "peft", encoder, fmt="safetensors")
    server = ServerThread(model_dir, prefix_store_path=str(tmp_path), max_batch_size=8)
    try:
        cases = {"enc": (None, encoder), "dec": (decoder, None), "both": (decoder, encoder)}
        checks: list[Callable[[], None]] = []
        for adapter_id, (dec, enc) in cases.items():
            expected = reference.greedy_with_prefix(
                model_dir, PROMPTS[0], NEW_TOKENS, decoder=dec, encoder=enc
            )
            checks.append(partial(_check, server, _request(PROMPTS[0], adapter_id), expected))
        _concurrently(checks)
        for adapter_id, reason in (
            ("odd", "Encoder/decoder prefix tensor must be of even length"),
            ("peft", "encoder-decoder architectures not supported for peft models"),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                server.stub.Generate(_request(PROMPTS[0], adapter_id), timeout=60)
            assert raised.value.details() == f"can't retrieve prompt prefix with id '{adapter_id}': {reason}"
    finally:
        server.stop()


# ---- LoRA ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_lora_adapters_and_the_base_model_share_a_batch(model_dirs, tmp_path):
    model_dir = model_dirs("llama")
    write_lora(tmp_path, "lora/a", model_dir, seed=1)
    write_lora(tmp_path, "lora/b", model_dir, seed=2)
    server = ServerThread(model_dir, prefix_store_path=str(tmp_path), max_batch_size=8)
    try:
        expected = {
            "lora/a": reference.greedy_with_lora(model_dir, tmp_path / "lora/a", PROMPTS[0], NEW_TOKENS),
            "lora/b": reference.greedy_with_lora(model_dir, tmp_path / "lora/b", PROMPTS[0], NEW_TOKENS),
            "": reference.greedy(model_dir, PROMPTS[0], NEW_TOKENS),
        }
        assert len({e.text for e in expected.values()}) == 3  # the adapters really change the output
        checks = [
            partial(_check, server, _request(PROMPTS[0], adapter_id), e)
            for adapter_id, e in expected.items()
            for _ in range(2)
        ]
        _concurrently(checks)
    finally:
        server.stop()


@pytest.mark.slow
def test_many_lora_adapters_in_turn_stay_within_the_cache(model_dirs, tmp_path):
    model_dir = model_dirs("gpt2")
    ids = [f"lora{i}" for i in range(6)]
    for seed, adapter_id in enumerate(ids):
        write_lora(tmp_path, adapter_id, model_dir, seed=seed, r=128)
    one_adapter = sum(f.stat().st_size for f in (tmp_path / ids[0]).glob("*.safetensors"))
    budget_mb = 1
    assert 2 * one_adapter < budget_mb * 2**20 < 6 * one_adapter, "fixture sizes no longer exercise eviction"
    server = ServerThread(
        model_dir, prefix_store_path=str(tmp_path), prompt_cache_size_mb=budget_mb, max_batch_size=4
    )
    try:
        store = server.server.adapters
        assert store is not None
        for round_ in range(2):
            for adapter_id in ids:
                expected = reference.greedy_with_lora(
                    model_dir, tmp_path / adapter_id, PROMPTS[1], NEW_TOKENS
                )
                (answer,) = server.stub.Generate(_request(PROMPTS[1], adapter_id), timeout=120).responses
                assert answer.text == expected.text, (round_, adapter_id)
                assert store.cached_bytes <= budget_mb * 2**20
                engine = server.engine
                assert isinstance(engine, HFTransformersEngine | PagedHFEngine) and engine.loras is not None
                assert len(engine.loras.loaded) <= len(store) + 1  # the engine unloads what the store evicts
            assert len(store) < len(ids)
    finally:
        server.stop()


def test_engines_that_cannot_serve_an_adapter_kind_refuse_it_with_invalid_argument(model_dirs, tmp_path):
    model_dir = model_dirs("llama")
    write_lora(tmp_path, "lora", model_dir, seed=1)
    write_raw_prefix(tmp_path, "prefix", decoder=_prefix(model_dir, 2, seed=1))
    server = ServerThread(model_dir, prefix_store_path=str(tmp_path), deployment_framework="hf_custom_tp")
    try:
        with pytest.raises(grpc.RpcError) as raised:
            server.stub.Generate(_request(PROMPTS[0], "lora"), timeout=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details() == (
            "can't retrieve prompt prefix with id 'lora': LoRA adapters are not supported by the "
            "hf_custom_tp engine"
        )
        (answer,) = server.stub.Generate(_request(PROMPTS[0], "prefix"), timeout=60).responses
        assert answer.generated_token_count == NEW_TOKENS  # prefixes do work there
    finally:
        server.stop()


def test_a_lora_adapter_that_fails_to_load_at_batch_time_fails_only_its_requests(model_dirs, tmp_path):
    # Adapted for llama's q_proj/v_proj: the store accepts the files, peft cannot place them in gpt2.
    write_lora(tmp_path, "for_llama", model_dirs("llama"), seed=1)
    model_dir = model_dirs("gpt2")
    server = ServerThread(model_dir, prefix_store_path=str(tmp_path), max_batch_size=4)
    try:
        expected = reference.greedy(model_dir, PROMPTS[2], NEW_TOKENS)
        with ThreadPoolExecutor(2) as pool:
            failing = pool.submit(server.stub.Generate, _request(PROMPTS[0], "for_llama"), timeout=60)
            plain = pool.submit(server.stub.Generate, _request(PROMPTS[2]), timeout=60)
            assert plain.result().responses[0].text == expected.text
            with pytest.raises(grpc.RpcError) as raised:
                failing.result()
        assert raised.value.code() == grpc.StatusCode.UNKNOWN
        assert raised.value.details() == (
            "Request failed during generation: Error retrieving prompt prefix 'for_llama'"
        )
        (answer,) = server.stub.Generate(_request(PROMPTS[2]), timeout=60).responses
        assert answer.text == expected.text  # the engine is unchanged and still serves
    finally:
        server.stop()
