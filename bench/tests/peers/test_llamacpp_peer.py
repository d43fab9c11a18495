"""llama.cpp's server as the benchmark's peer, for real: skipped unless LLAMACPP_PYTHON (a Python with
xllamacpp) and LLAMACPP_GGUF_DIR (the benchmark model's GGUF conversions, README "Benchmarking") are set.
Figures are checked, not timed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tgis_bench.load.workload import LengthRange, WorkloadSpec, build_sweep, build_workload
from tgis_bench.models.build import ensure_bench_model
from tgis_bench.peers.base import measure_peer
from tgis_bench.peers.llamacpp import LlamaCppPeer

PYTHON = os.environ.get("LLAMACPP_PYTHON")
GGUF_DIR = os.environ.get("LLAMACPP_GGUF_DIR")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (PYTHON and GGUF_DIR), reason="LLAMACPP_PYTHON and LLAMACPP_GGUF_DIR are not set"),
]


@pytest.mark.parametrize(("suffix", "file_type", "cache"), [("f32", "F32", "f32"), ("q8_0", "Q8_0", "f16")])
def test_llamacpp_gets_the_exact_ids_and_makes_exactly_the_asked_tokens(
    suffix: str, file_type: str, cache: str, caplog: pytest.LogCaptureFixture
):
    assert PYTHON and GGUF_DIR
    model_dir = ensure_bench_model()
    gguf_file = Path(GGUF_DIR) / f"{model_dir.name}-{suffix}.gguf"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = WorkloadSpec(4, LengthRange(8, 40), LengthRange(3, 6), seed=3)
    requests = build_workload(tokenizer, spec)
    peer = LlamaCppPeer.for_gguf(Path(PYTHON), gguf_file, slots=2, slot_context=1024)
    assert (peer.name, peer.cache_type) == (f"llama.cpp {file_type} (xllamacpp)", cache)
    with caplog.at_level(logging.WARNING, logger="tgis_bench.peers.base"):
        result = measure_peer(peer, build_sweep(tokenizer, spec, requests, (1, 2), warmup=2), progress=False)
    # The server counted every prompt as sent (not tokenized again, no BOS added) and made every token.
    assert [record.getMessage() for record in caplog.records] == []
    assert result.name == peer.name and result.version.startswith("llama.cpp (xllamacpp ")
    assert "its build uses the CPU features" in result.settings
    asked = sum(r.max_new_tokens for r in requests)
    assert [run.concurrency for run in result.runs] == [1, 2]
    for run in result.runs:
        assert run.requests == 4 and run.short_requests == 0 and run.generated_tokens == asked
        assert run.ttft is not None and run.inter_token is not None and run.tokens_per_second > 0
        assert run.ttft.p50 <= run.latency.p50
