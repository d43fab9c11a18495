"""hf_custom_tp specifics: every shard plan against the unsharded model, startup errors, dead shards."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from engines import hf_custom_tp
from engines.base import EngineConfig, EngineFatalError, LoraAdapter, PrefillRow, PrefixEmbeddings
from engines.hf_custom_tp.commands import (
    Allocate,
    Clear,
    Decode,
    KeepRows,
    Prefill,
    Step,
    Stop,
    decode,
    encode,
    prefix_shape,
)
from engines.hf_custom_tp.engine import load_shard
from engines.hf_custom_tp.layers import Shard
from engines.hf_custom_tp.plans import UnsupportedShardingError
from engines.hf_custom_tp.processes import _Worker
from engines.hf_custom_tp.weights import NO_SAFETENSORS
from engines.paged.engine import PagedHFEngine
from engines.step import SequenceChunk, StepBatch
from tests.engines.driver import NEW_TOKENS, Run, reference_greedy
from tests.engines.test_adapters import (
    AdapterRun,
    ids_of,
    prefix_rows,
    random_prefix,
    reference_prefixed_greedy,
)
from tests.integration import reference
from tests.integration.harness import wait_until
from tests.launcher import Launched, launcher_env
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

# Architectures and layouts beyond the five fixture models, built here at the same tiny size.
EXTRA_MODELS: dict[str, dict[str, Any]] = {
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "falcon-grouped": {
        "model_type": "falcon",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "new_decoder_architecture": True,
        "alibi": False,
        "bias": False,
    },
    "falcon-multi-query": {
        "model_type": "falcon",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "multi_query": True,
        "new_decoder_architecture": False,
        "alibi": False,
        "bias": True,
    },
    "falcon-multi-head": {
        "model_type": "falcon",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "multi_query": False,
        "new_decoder_architecture": False,
        "alibi": False,
        "bias": True,
        "parallel_attn": False,
    },
    "gpt_bigcode-multi-query": {
        "model_type": "gpt_bigcode",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 256,
        "multi_query": True,
    },
    "gpt_bigcode-multi-head": {
        "model_type": "gpt_bigcode",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 256,
        "multi_query": False,
    },
    # 771 rows split 386 + 385: the last rank's logits are padded for the all-gather, then cut.
    "gpt2-uneven-vocabulary": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 256,
        "vocab_size": 771,
        "tie_word_embeddings": False,
    },
}
PROMPTS = {"short": (5, 17, 99), "long": (300, 12, 77, 401, 8, 250, 61, 9, 700, 33)}


def build_extra(out_dir: Path, name: str) -> Path:
    settings = dict(EXTRA_MODELS[name])
    model_type = settings.pop("model_type")
    settings = {"vocab_size": 768, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2} | settings
    config = AutoConfig.for_model(model_type, initializer_range=0.3, **settings)
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def extra_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_extra(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


def padded(engine: Any) -> hf_custom_tp.TensorParallelEngine:
    """The engine loaded with paged=False, typed as the row-driven one."""
    assert isinstance(engine, hf_custom_tp.TensorParallelEngine)
    return engine


def run_ranks_in_threads(
    model_dir: Path, world_size: int, work: Callable[[Any], Any], *, paged: bool = False
) -> list[Any]:
    """Every rank's shard in its own thread of this process, each running `work(engine)` (the padded
    engine unless `paged`)."""
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=30))
            engine = load_shard(
                EngineConfig(model_path=model_dir, paged=paged),
                Shard(rank, world_size, group),
                torch.device("cpu"),
            )
            results[rank] = work(engine)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return results


def greedy_tokens(engine: Any) -> dict[str, list[int]]:
    run = Run(engine, frozenset(engine.spec.eos_token_ids))
    run.join({"short": PROMPTS["short"]})
    run.step()
    run.join({"long": PROMPTS["long"]})  # joins a running batch, so the caches are merged
    run.finish()
    return run.tokens


@pytest.mark.parametrize("name", list(EXTRA_MODELS))
def test_sharded_layouts_decode_like_the_unsharded_model(extra_models, name):
    model_dir = extra_models(name)
    ranks = run_ranks_in_threads(model_dir, 2, greedy_tokens)
    assert ranks[0] == ranks[1]
    for prompt, ids in PROMPTS.items():
        assert tuple(ranks[0][prompt]) == reference_greedy(model_dir, ids), prompt


def test_four_shards_of_one_head_each_decode_like_the_unsharded_model(model_dirs):
    model_dir = model_dirs("gpt2")  # 4 heads; llama's 2 key/value heads cannot split 4 ways
    ranks = run_ranks_in_threads(model_dir, 4, greedy_tokens)
    for prompt, ids in PROMPTS.items():
        assert tuple(ranks[0][prompt]) == reference_greedy(model_dir, ids), prompt


def test_unsupported_architecture_fails_at_startup_naming_it(tmp_path):
    AutoConfig.for_model(
        "opt", hidden_size=64, num_hidden_layers=1, num_attention_heads=4, ffn_dim=128, vocab_size=64
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedShardingError, match="cannot shard model type opt"):
        hf_custom_tp.load(EngineConfig(model_path=tmp_path, num_shards=2))


def test_heads_that_do_not_divide_fail_at_startup(model_dirs):
    with pytest.raises(
        UnsupportedShardingError,
        match=re.escape("num_attention_heads (4) is not divisible by the number of shards (3)"),
    ):
        hf_custom_tp.load(EngineConfig(model_path=model_dirs("llama"), num_shards=3))


def test_checkpoint_without_safetensors_fails_with_tgis_message(model_dirs, tmp_path):
    model_dir = tmp_path / "bin-only"
    model_dir.mkdir()
    shutil.copy(model_dirs("llama") / "config.json", model_dir)
    torch.save({}, model_dir / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(NO_SAFETENSORS)}$"):
        hf_custom_tp.load(EngineConfig(model_path=model_dir, num_shards=2))


@pytest.mark.parametrize(
    "command",
    [
        Prefill((PrefillRow((1, 2, 3), want_prompt_logits=True), PrefillRow((7,)), PrefillRow((4, 5)))),
        Decode((9, 8, 7)),
        KeepRows((0, 2)),
        KeepRows(()),
        Clear(),
        Stop(),
    ],
)
def test_step_commands_survive_their_tensor_encoding(command):
    op, payload, floats = encode(command)
    assert floats is None
    assert decode(op, payload) == command


def test_prefill_prefix_rows_survive_their_tensor_encoding():
    decoder = torch.randn(3, 8, dtype=torch.float16)
    encoder = torch.randn(2, 8, dtype=torch.bfloat16)
    rows = (
        PrefillRow((1, 2), prefix=PrefixEmbeddings(decoder=decoder)),
        PrefillRow((3,), want_prompt_logits=True),
        PrefillRow((4, 5, 6), prefix=PrefixEmbeddings(decoder=decoder[:1], encoder=encoder)),
    )
    op, payload, floats = encode(Prefill(rows))
    assert floats is not None and prefix_shape(op, payload) == tuple(floats.shape) == (6, 8)
    received = decode(op, payload, floats.clone())
    assert isinstance(received, Prefill)
    assert [row.input_ids for row in received.rows] == [(1, 2), (3,), (4, 5, 6)]
    assert [row.want_prompt_logits for row in received.rows] == [False, True, False]
    first, second, third = (row.prefix for row in received.rows)
    assert second is None and first is not None and third is not None
    assert first.encoder is None and first.decoder is not None and torch.equal(first.decoder.half(), decoder)
    assert third.decoder is not None and torch.equal(third.decoder.half(), decoder[:1])
    assert third.encoder is not None and torch.equal(third.encoder.bfloat16(), encoder)


def test_a_prefill_with_a_lora_adapter_cannot_be_sent_to_the_shards(tmp_path):
    row = PrefillRow((1,), lora=LoraAdapter("a", tmp_path))
    with pytest.raises(ValueError, match=r"cannot send PrefillRow\.lora"):
        encode(Prefill((row,)))


def test_a_shard_killed_by_sigbus_is_reported_with_the_shared_memory_advice():
    class Killed:
        pid = 4321

        def poll(self) -> int:
            return -signal.SIGBUS

    message = _Worker(1, Killed()).death()  # type: ignore[arg-type]
    assert message is not None
    assert message.startswith("hf_custom_tp shard 1 (pid 4321) exited with code -7; ")
    assert "/dev/shm" in message and "at least 1 GB" in message


def test_a_dead_shard_is_reported_at_once_and_fails_every_later_step(model_dirs):
    deaths: list[str] = []
    engine = padded(
        hf_custom_tp.load(
            EngineConfig(model_path=model_dirs("llama"), num_shards=2, master_port=0, paged=False),
            on_shard_death=deaths.append,
        )
    )
    try:
        engine.prefill([PrefillRow((2, 10, 11))])
        (pid,) = engine.worker_pids
        os.kill(pid, signal.SIGKILL)
        message = wait_until(lambda: deaths and deaths[0], "the watcher reports the dead shard", timeout=30)
        assert message == f"hf_custom_tp shard 1 (pid {pid}) exited with code -9"
        with pytest.raises(EngineFatalError, match=re.escape(message)) as raised:
            engine.decode([5])
        # Not an Exception: per-request handlers must let it through to the loop, which stops the server.
        assert not isinstance(raised.value, Exception)
    finally:
        engine.close()


def test_launcher_exits_non_zero_naming_the_shard_that_died(model_dirs):
    env = launcher_env(
        MODEL_NAME=str(model_dirs("gpt2")), DEPLOYMENT_FRAMEWORK="tgis_native", NUM_SHARD="2", MASTER_PORT="0"
    )
    run = Launched(env)

    def serving_shard_pid() -> int | None:
        found = re.search(r"started shard 1 of 2 \(pid (\d+)\)", run.log())
        return int(found.group(1)) if found and run.port("gRPC") else None

    try:
        pid = wait_until(
            lambda: serving_shard_pid() or run.process.poll() is not None, "the server serves", 240
        )
        assert run.process.poll() is None, run.log()
        os.kill(pid, signal.SIGKILL)
        code = run.process.wait(60)
    finally:
        if run.process.poll() is None:
            run.process.kill()
    assert code != 0, run.log()
    assert f"hf_custom_tp shard 1 (pid {pid}) exited with code -9" in run.log()


def test_launcher_serves_sharded_then_exits_zero_on_sigterm_leaving_no_shard_behind(model_dirs):
    env = launcher_env(MODEL_NAME=str(model_dirs("gpt2")), NUM_SHARD="2", MASTER_PORT="0")
    run = Launched(env)  # DEPLOYMENT_FRAMEWORK unset: hf_transformers hands two shards to hf_custom_tp
    try:
        port = wait_until(
            lambda: run.port("gRPC") or run.process.poll() is not None, "the server serves", 240
        )
        assert run.process.poll() is None, run.log()
        stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(f"localhost:{port}"))
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="Hello world")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=6)),
        )
        answer = stub.Generate(request, timeout=60).responses[0]
        assert answer.text == reference.greedy(model_dirs("gpt2"), "Hello world", 6).text
        found = re.search(r"started shard 1 of 2 \(pid (\d+)\)", run.log())
        assert found, run.log()
        run.process.send_signal(signal.SIGTERM)
        assert run.process.wait(8) == 0, run.log()
    finally:
        if run.process.poll() is None:
            run.process.kill()
    wait_until(lambda: not Path(f"/proc/{found.group(1)}").exists(), "the shard process is gone", 10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_shards_over_nccl_decode_like_transformers(model_dirs):
    engine = padded(
        hf_custom_tp.load(
            EngineConfig(
                model_path=model_dirs("llama"), num_shards=2, master_port=0, dtype="float32", paged=False
            )
        )
    )
    try:
        assert engine.spec.device.type == "cuda"
        tokens = greedy_tokens(engine)
        for prompt, ids in PROMPTS.items():
            assert tuple(tokens[prompt]) == reference_greedy(model_dirs("llama"), ids), prompt
    finally:
        engine.close()


def test_prefix_rows_reach_every_shard_and_decode_like_transformers(model_dirs):
    model_dir = model_dirs("llama")
    engine = padded(
        hf_custom_tp.load(EngineConfig(model_path=model_dir, num_shards=2, master_port=0, paged=False))
    )
    try:
        ids = ids_of(model_dir)
        prefixes = {"a": random_prefix(model_dir, 4, 1), "b": None, "d": random_prefix(model_dir, 3, 2)}
        run = AdapterRun(engine, frozenset(engine.spec.eos_token_ids))
        run.join_rows({name: PrefillRow(ids[name], prefix=prefix_rows(prefixes[name])) for name in "ab"})
        run.step()
        run.join_rows({"d": PrefillRow(ids["d"], prefix=prefix_rows(prefixes["d"]))})
        run.finish()
        for name in "abd":
            assert run.tokens[name] == reference_prefixed_greedy(model_dir, prefixes[name], ids[name]), name
        assert run.tokens["a"] != list(reference_greedy(model_dir, ids["a"]))
    finally:
        engine.close()


def test_paged_steps_round_trip_through_their_tensor_encoding():
    prefix = torch.randn(3, 8)
    batch = StepBatch(
        decode=(SequenceChunk((5,), 9, (2, 3), sample=True),),
        prefill=(
            SequenceChunk((1, 2, 3, 4), 0, (7,), all_logits=True, prefix=PrefixEmbeddings(decoder=prefix)),
            SequenceChunk((8, 9), 4, (6, 1)),
        ),
    )
    op, payload, floats = encode(Step(batch))
    assert prefix_shape(op, payload) == (3, 8)
    received = decode(op, payload, floats)
    assert isinstance(received, Step)
    assert received.batch.decode == batch.decode
    assert received.batch.prefill[1] == batch.prefill[1]
    first = received.batch.prefill[0]
    assert (first.token_ids, first.start, first.block_table, first.sample, first.all_logits) == (
        (1, 2, 3, 4),
        0,
        (7,),
        False,
        True,
    )
    assert first.prefix is not None and first.prefix.decoder is not None
    torch.testing.assert_close(first.prefix.decoder, prefix)
    assert decode(*encode(Allocate(40, 16))) == Allocate(40, 16)
    lora = dataclasses.replace(batch.decode[0], lora=LoraAdapter("a", Path("a")))
    with pytest.raises(ValueError, match="cannot send LoRA adapters"):
        encode(Step(StepBatch(decode=(lora,))))


def paged_greedy(
    engine: PagedHFEngine, prompts: dict[str, tuple[int, ...]], chunk: int = 4
) -> dict[str, list[int]]:
    """Greedy generation of every prompt at once over paged steps: decode tokens first, then prompt
    chunks of at most `chunk` tokens, as the service plans them."""
    engine.allocate(64, 4)
    names = list(prompts)
    tokens = {name: list(ids) for name, ids in prompts.items()}
    computed = dict.fromkeys(names, 0)
    tables = {name: tuple(range(16 * i, 16 * (i + 1))) for i, name in enumerate(names)}
    generated: dict[str, list[int]] = {name: [] for name in names}
    while any(len(generated[name]) < NEW_TOKENS for name in names):
        decoding = [n for n in names if computed[n] >= len(prompts[n]) and len(generated[n]) < NEW_TOKENS]
        prefilling = [n for n in names if computed[n] < len(prompts[n])]
        decode_chunks = tuple(
            SequenceChunk((tokens[n][-1],), computed[n], tables[n], sample=True) for n in decoding
        )
        prefill_chunks, lengths = [], {}
        for n in prefilling:
            lengths[n] = min(chunk, len(prompts[n]) - computed[n])
            end = computed[n] + lengths[n]
            ids = tuple(tokens[n][computed[n] : end])
            prefill_chunks.append(SequenceChunk(ids, computed[n], tables[n], sample=end == len(prompts[n])))
        output = engine.step(StepBatch(decode_chunks, tuple(prefill_chunks)))
        sampling = [*decoding, *(n for n in prefilling if computed[n] + lengths[n] == len(prompts[n]))]
        for n in decoding:
            computed[n] += 1
        for n in prefilling:
            computed[n] += lengths[n]
        for n, logits in zip(sampling, output.logits, strict=True):
            token = int(logits.argmax())
            tokens[n].append(token)
            generated[n].append(token)
    return generated


def test_two_ranks_run_the_paged_step_like_transformers(model_dirs):
    model_dir = model_dirs("llama")
    results = run_ranks_in_threads(model_dir, 2, lambda engine: paged_greedy(engine, PROMPTS), paged=True)
    for generated in results:  # every rank computes the same logits
        for name, ids in PROMPTS.items():
            assert tuple(generated[name]) == reference_greedy(model_dir, ids)[: len(generated[name])], name
