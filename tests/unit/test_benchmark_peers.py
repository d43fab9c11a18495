"""The benchmark's peers without vLLM: how each is started and asked, and how its stream is read."""

from __future__ import annotations

from pathlib import Path

from tgis.benchmark.client import LoadRun, RequestTiming
from tgis.benchmark.peer import mismatches, parse_event
from tgis.benchmark.vllm_peer import VllmPeer, chunk_tokens
from tgis.benchmark.workload import BenchRequest

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
