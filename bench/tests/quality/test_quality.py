"""`tgis-bench quality`: perplexity and top-1 agreement through real servers, checked against
transformers' own logits for the same windows."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.integration.harness import ServerThread
from tgis_bench.quality.cli import corpus_windows, main, measure

TEXT = " ".join(f"The {word} sat on the mat and looked at the {other} door." for word, other in
                [("cat", "red"), ("dog", "blue"), ("bird", "green"), ("fox", "old")] * 6)  # fmt: skip


def test_perplexity_is_the_models_and_a_server_agrees_with_itself(model_dirs, tmp_path: Path) -> None:
    model_dir = model_dirs("gpt2")
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    windows = corpus_windows(model_dir, 24, 3, text_file)
    assert len(windows) == 3
    plain, quantized = ServerThread(model_dir), ServerThread(model_dir, quantize="int8")
    try:
        target = f"localhost:{plain.server.grpc_port}"
        results = measure(
            [("float32", target), ("again", target), ("int8", f"localhost:{quantized.server.grpc_port}")],
            windows,
        )
    finally:
        plain.stop()
        quantized.stop()
    baseline, again, int8 = results
    assert (again.perplexity_ratio, again.top1_agreement) == (1.0, 1.0)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    total, count = 0.0, 0
    for window in windows:
        ids = tokenizer(window, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
        total += float(logprobs.gather(1, ids[0, 1:, None]).sum())
        count += ids.shape[1] - 1
    assert baseline.positions == count
    assert math.isclose(baseline.perplexity, math.exp(-total / count), rel_tol=1e-4)
    assert int8.perplexity_ratio != 1.0 and 0.8 < int8.top1_agreement < 1.0


def test_the_command_writes_its_report(model_dirs, tmp_path: Path) -> None:
    model_dir = model_dirs("gpt2")
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT)
    server = ServerThread(model_dir)
    try:
        target = f"base=localhost:{server.server.grpc_port}"
        args = ["--server", target, "--model-dir", str(model_dir), "--text", str(text_file), "--window", "16"]
        assert main([*args, "--windows", "2", "--out", str(tmp_path / "out")]) == 0
    finally:
        server.stop()
    assert "| base |" in (tmp_path / "out" / "QUALITY.md").read_text()
    assert (tmp_path / "out" / "quality.json").is_file()
