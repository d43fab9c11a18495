"""The benchmark's peers without vLLM or llama.cpp: how each is started and asked, how its stream is read
and timed (against a local stand-in speaking llama.cpp's stream format), and the GGUF header reader."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from tgis_bench.load.cli import parser
from tgis_bench.load.client import LoadRun, RequestTiming
from tgis_bench.load.run import BenchmarkConfig, peers_of
from tgis_bench.load.workload import BenchRequest, LengthRange, WorkloadSpec
from tgis_bench.peers import gguf, llamacpp_serve
from tgis_bench.peers.base import mismatches, parse_event, run_peer_load
from tgis_bench.peers.llamacpp import LAUNCHER, LlamaCppPeer, build_features
from tgis_bench.peers.vllm import VllmPeer, chunk_tokens

REQUEST = BenchRequest(0, "x", (5, 6, 7), 9)


# ---- vLLM --------------------------------------------------------------------------------------------


def test_vllm_is_asked_for_the_same_ids_and_exactly_the_same_token_count():
    peer = VllmPeer(Path("/venv/bin/python"), Path("/models/m"), "bfloat16")
    body = peer.body(REQUEST)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == body["min_tokens"] == 9
    assert body["temperature"] == 0.0 and body["ignore_eos"] and body["stream"]
    command = peer.command(8000)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--max-num-seqs") + 1] == "32"
    assert peer.environment()["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_vllm_stream_events_are_parsed_and_counted():
    assert parse_event(b"data: [DONE]\n") is None and parse_event(b": ping\n") is None
    event = parse_event(b'data: {"choices": [{"text": "ab", "token_ids": [4, 5]}]}\n')
    assert event is not None and chunk_tokens(event) == 2
    assert chunk_tokens({"choices": [{"text": "a"}]}) == 1  # a server that does not list token ids
    peer = VllmPeer(Path("py"), Path("m"), "float32")
    last = peer.progress({"choices": [{"token_ids": [3], "finish_reason": "length"}]})
    assert (last.tokens, last.stop_reason) == (1, "MAX_TOKENS")
    usage = peer.progress({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 7}})
    assert (usage.tokens, usage.generated, usage.input_tokens, usage.stop_reason) == (0, 3, 7, None)


# ---- llama.cpp: command line, request, stream --------------------------------------------------------


def _llamacpp(
    file_type: str = "BF16", slots: int = 32, slot_context: int = 1024, threads: int = 2
) -> LlamaCppPeer:
    gguf_file = Path("/gguf/bench-bf16.gguf")
    return LlamaCppPeer(Path("/llama/bin/python"), gguf_file, file_type, slots, slot_context, threads)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_llamacpp_is_started_with_a_slot_per_request_room_for_each_every_core_and_a_matching_cache():
    command = _llamacpp(slots=32, slot_context=1024, threads=2).command(8123)
    assert command[:2] == ["/llama/bin/python", str(LAUNCHER)]
    assert _flag(command, "--model") == "/gguf/bench-bf16.gguf"
    assert (_flag(command, "--host"), _flag(command, "--port")) == ("127.0.0.1", "8123")
    assert _flag(command, "--parallel") == "32"
    assert _flag(command, "--ctx-size") == str(32 * 1024)  # llama.cpp splits it over the slots
    assert _flag(command, "--threads") == "2"
    assert _flag(command, "--cache-type") == "bf16"
    assert _flag(_llamacpp("F32").command(1), "--cache-type") == "f32"
    assert _flag(_llamacpp("Q8_0").command(1), "--cache-type") == "f16"  # llama.cpp's default
    assert _llamacpp("Q8_0").name == "llama.cpp Q8_0 (xllamacpp)"


def test_a_native_llama_server_gets_its_own_flags_for_the_same_settings():
    peer = LlamaCppPeer(
        Path("/llama/bin/llama-server"), Path("/gguf/bench-f32.gguf"), "F32", 8, 512, 2, native=True
    )
    command = peer.command(8123)
    assert command[0] == "/llama/bin/llama-server" and str(LAUNCHER) not in command
    assert (_flag(command, "--parallel"), _flag(command, "--ctx-size")) == ("8", str(8 * 512))
    assert _flag(command, "--threads") == _flag(command, "--threads-batch") == "2"
    assert _flag(command, "--cache-type-k") == _flag(command, "--cache-type-v") == "f32"
    assert "--cont-batching" in command and "--cache-type" not in command
    assert peer.name == "llama.cpp F32"


def test_the_launchers_flags_parse_as_the_peer_writes_them():
    args = llamacpp_serve.parser().parse_args(_llamacpp("F32").command(8123)[2:])
    assert (args.model, args.port, args.parallel, args.ctx_size) == ("/gguf/bench-bf16.gguf", 8123, 32, 32768)
    assert (args.threads, args.cache_type, args.info) == (2, "f32", False)


def _fake_xllamacpp() -> types.SimpleNamespace:
    """The attributes of xllamacpp that `configure` sets, as plain objects."""

    def params() -> types.SimpleNamespace:
        return types.SimpleNamespace(
            model=types.SimpleNamespace(path=None),
            cpuparams=types.SimpleNamespace(n_threads=-1),
            cpuparams_batch=types.SimpleNamespace(n_threads=-1),
        )

    ggml_type = types.SimpleNamespace(GGML_TYPE_F32="f32-type", GGML_TYPE_BF16="bf16-type")
    return types.SimpleNamespace(CommonParams=params, ggml_type=ggml_type)


def test_the_launcher_configures_the_server_as_asked():
    args = llamacpp_serve.parser().parse_args(_llamacpp("BF16").command(8123)[2:])
    params = llamacpp_serve.configure(_fake_xllamacpp(), args)
    assert params.model.path == "/gguf/bench-bf16.gguf"
    assert (params.hostnames, params.port) == (["127.0.0.1"], 8123)
    assert (params.n_parallel, params.n_ctx, params.cont_batching) == (32, 32768, True)
    assert params.cpuparams.n_threads == params.cpuparams_batch.n_threads == 2
    assert params.cache_type_k == params.cache_type_v == "bf16-type"


def test_llamacpp_is_asked_for_the_ids_as_they_are_and_exactly_the_token_count():
    body = _llamacpp().body(REQUEST)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 9 and body["ignore_eos"]
    assert body["temperature"] == 0.0 and body["stream"] and body["return_tokens"]


def test_llamacpp_stream_events_are_read_for_tokens_counts_and_stop():
    peer = _llamacpp()
    step = peer.progress(
        {"content": " st", "tokens": [1055], "stop": False, "tokens_predicted": 1, "tokens_evaluated": 6}
    )
    assert (step.tokens, step.generated, step.input_tokens, step.stop_reason) == (1, 1, 6, None)
    held = peer.progress({"content": "ab", "tokens": [7, 8], "stop": False, "tokens_predicted": 3})
    assert held.tokens == 2  # text held back for a whole character comes with both tokens
    last = peer.progress(
        {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 3}
    )
    assert (last.tokens, last.stop_reason, last.generated) == (0, "MAX_TOKENS", 3)
    assert peer.progress({"stop": True, "stop_type": "eos"}).stop_reason == "EOS_TOKEN"


def test_build_features_keep_what_the_build_enables():
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | AVX512_BF16 = 0 | OPENMP = 1 | "
    assert build_features(info) == ["SSE3", "AVX", "AVX2", "OPENMP"]
    assert build_features("") == []


def test_llamacpp_peers_are_made_one_per_gguf_and_named_by_their_file_type(tmp_path: Path):
    files = [
        _write_gguf(tmp_path / f"m-{name}.gguf", file_type=ident) for name, ident in (("f32", 0), ("q8", 7))
    ]
    config = BenchmarkConfig(
        server="x:1",
        model_dir=tmp_path,
        workload=WorkloadSpec(2, LengthRange(4, 4), LengthRange(2, 2)),
        concurrency=(1, 4),
        llamacpp_python=Path("py"),
        llamacpp_server=Path("llama-server"),
        llamacpp_ggufs=tuple(files),
    )
    longest = BenchRequest(0, "x", tuple(range(1500)), 10)
    peers = peers_of(config, [REQUEST, longest])
    assert [peer.name for peer in peers] == [
        "llama.cpp F32",
        "llama.cpp Q8_0",
        "llama.cpp F32 (xllamacpp)",
        "llama.cpp Q8_0 (xllamacpp)",
    ]
    assert all(isinstance(p, LlamaCppPeer) and (p.slots, p.slot_context) == (4, 1510) for p in peers)
    assert [p.native for p in peers if isinstance(p, LlamaCppPeer)] == [True, True, False, False]
    with pytest.raises(ValueError, match="its program \\(Python or server\\) and a GGUF"):
        BenchmarkConfig(
            server="x:1", model_dir=tmp_path, workload=config.workload, llamacpp_python=Path("py")
        )


def test_the_command_line_takes_a_llamacpp_python_and_several_ggufs(tmp_path: Path):
    args = parser().parse_args(
        [
            "--model-dir",
            "m",
            "--llamacpp-python",
            "py",
            "--llamacpp-gguf",
            "a.gguf",
            "--llamacpp-gguf",
            "b.gguf",
        ]
    )
    assert args.llamacpp_python == Path("py") and args.llamacpp_gguf == [Path("a.gguf"), Path("b.gguf")]
    assert parser().parse_args(["--model-dir", "m"]).llamacpp_gguf == []


# ---- the streamed loop against a stand-in speaking llama.cpp's format ---------------------------------


def _events(request: dict[str, object]) -> list[dict[str, object]]:
    """What llama.cpp streams for a request: one event per token, then a closing event with counts."""
    prompt, count = request["prompt"], request["n_predict"]
    assert isinstance(prompt, list) and isinstance(count, int)
    events: list[dict[str, object]] = [
        {"content": "t", "tokens": [100 + i], "stop": False, "tokens_predicted": i + 1} for i in range(count)
    ]
    closing = {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": count}
    return [*events, {**closing, "tokens_evaluated": len(prompt)}]


async def _completion(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in _events(body):
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await asyncio.sleep(0.002)
    await response.write_eof()
    # As llama.cpp does after a streamed answer: it said keep-alive, then closes the connection.
    assert request.transport is not None
    request.transport.close()
    return response


@pytest.fixture
def stand_in() -> Iterator[str]:
    app = web.Application()
    app.router.add_post("/completion", _completion)
    loop = asyncio.new_event_loop()
    # No access log: its thread could write a request's line after pytest had closed the captured stream.
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_the_streamed_loop_times_every_token_of_every_request(stand_in: str):
    requests = [BenchRequest(i, "x", tuple(range(3 + i)), 4 + i) for i in range(6)]
    run = asyncio.run(run_peer_load(stand_in, _llamacpp(), requests, concurrency=2, progress=False))
    assert [t.index for t in run.requests] == list(range(6))  # a closed connection each time is no error
    for timing, request in zip(run.requests, requests, strict=True):
        assert timing.input_tokens == len(request.input_ids)
        assert timing.generated_tokens == timing.asked_tokens == request.max_new_tokens
        assert timing.stop_reason == "MAX_TOKENS"
        assert timing.ttft is not None and 0 < timing.ttft <= timing.latency <= run.seconds
        assert len(timing.inter_token) == request.max_new_tokens - 1
        assert min(timing.inter_token) > 0 and timing.ttft + sum(timing.inter_token) <= timing.latency


# ---- GGUF header ---------------------------------------------------------------------------------------


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _write_gguf(path: Path, *, file_type: int | None) -> Path:
    """A GGUF header as the converter writes it: strings, scalars and arrays before the file type."""
    kvs = [
        _string("general.architecture") + struct.pack("<I", 8) + _string("gpt2"),
        _string("gpt2.block_count") + struct.pack("<II", 4, 12),
        _string("general.tags") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + _string("bc"),
        _string("gpt2.norm") + struct.pack("<If", 6, 1e-5),
        _string("tokenizer.ggml.token_type") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 3, 1, 1),
    ]
    if file_type is not None:
        kvs.append(_string("general.file_type") + struct.pack("<II", 4, file_type))
    kvs.append(_string("tokenizer.ggml.pre") + struct.pack("<I", 8) + _string("gpt-2"))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    return path


@pytest.mark.parametrize(
    ("ident", "name"), [(0, "F32"), (1, "F16"), (7, "Q8_0"), (32, "BF16"), (99, "file type 99")]
)
def test_the_file_type_is_read_past_strings_scalars_and_arrays(tmp_path: Path, ident: int, name: str):
    path = _write_gguf(tmp_path / "m.gguf", file_type=ident)
    assert gguf.file_type_id(path) == ident and gguf.file_type(path) == name


def test_a_header_without_a_file_type_says_so_and_other_files_are_refused(tmp_path: Path):
    assert gguf.file_type(_write_gguf(tmp_path / "m.gguf", file_type=None)) == "unknown type"
    (tmp_path / "x.bin").write_bytes(b"PK\x03\x04rest")
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf.file_type(tmp_path / "x.bin")
    truncated = _write_gguf(tmp_path / "t.gguf", file_type=7).read_bytes()[:40]
    (tmp_path / "t.gguf").write_bytes(truncated)
    with pytest.raises(ValueError, match="truncated"):
        gguf.file_type(tmp_path / "t.gguf")


def test_a_peer_that_counts_the_prompt_otherwise_or_stops_early_is_reported():
    requests = [BenchRequest(0, "x", (1, 2, 3), 4), BenchRequest(1, "y", (4, 5), 4)]
    same = RequestTiming(0, 3, 4, 4, "MAX_TOKENS", 1.0, 0.1, (0.3,) * 3)
    bos_added = RequestTiming(1, 3, 4, 2, "EOS_TOKEN", 1.0, 0.1, (0.3,))
    problems = mismatches("llama.cpp F32", requests, LoadRun(2, True, 1.0, (same, bos_added)))
    assert problems == [
        "llama.cpp F32 counted 3 prompt tokens for request 1, sent 2",
        "llama.cpp F32 generated 2 tokens for request 1, asked 4",
    ]
    assert mismatches("p", requests[:1], LoadRun(1, True, 1.0, (same,))) == []
