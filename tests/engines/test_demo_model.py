"""The built-in demo model: built once into a cache, reused fast, deterministic and roughly readable."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tgis import demo_model

TINY_PLAN = dataclasses.replace(demo_model.PLAN, steps=3, vocab_size=600, layers=1, hidden=32, batch_size=2)


@dataclasses.dataclass(frozen=True)
class Built:
    root: Path
    path: Path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    root = tmp_path_factory.mktemp("demo-cache")
    return Built(root, demo_model.ensure_demo_model(root))


@pytest.mark.slow
def test_build_leaves_one_complete_versioned_directory(built: Built) -> None:
    assert built.path == built.root / demo_model.DIR_NAME
    assert demo_model.VERSION in built.path.name
    for name in ("config.json", "model.safetensors", "tokenizer.json", demo_model.MARKER):
        assert (built.path / name).is_file(), name
        assert (built.path / name).stat().st_mode & 0o044 == 0o044, name  # shareable cache
    assert [p.name for p in built.root.iterdir() if not p.name.endswith(".lock")] == [built.path.name]
    # No bound on the build time: ~30 s on 2 idle cores, but minutes on a contended box.


@pytest.mark.slow
def test_second_call_reuses_the_cache_quickly(built: Built, caplog: pytest.LogCaptureFixture) -> None:
    marker = built.path / demo_model.MARKER
    before = (marker.stat().st_mtime_ns, marker.read_bytes())
    caplog.set_level(logging.INFO, logger=demo_model.__name__)
    start = time.perf_counter()
    assert demo_model.ensure_demo_model(built.root) == built.path
    assert time.perf_counter() - start < 2.0
    assert (marker.stat().st_mtime_ns, marker.read_bytes()) == before
    assert f"Using the demo model at {built.path}" in caplog.text


@pytest.mark.slow
def test_tokenizer_uses_endoftext_for_every_special_and_adds_none(built: Built) -> None:
    tok = AutoTokenizer.from_pretrained(built.path)
    assert tok.eos_token == tok.bos_token == tok.pad_token == demo_model.EOS
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id
    assert tok("The Python")["input_ids"] == tok("The Python", add_special_tokens=False)["input_ids"]
    text = "Round trip: naïve café 👍🏽 東京"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert 2000 <= len(tok) <= 4000


@pytest.mark.slow
def test_greedy_continuation_reads_like_english(built: Built) -> None:
    model = AutoModelForCausalLM.from_pretrained(built.path).eval()
    tok = AutoTokenizer.from_pretrained(built.path)
    assert model.config.eos_token_id == tok.eos_token_id
    ids = tok("The Python", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :].tolist(), skip_special_tokens=True)
    assert isinstance(text, str)
    plain = sum(c.isascii() and (c.isalpha() or c in " ,.;:'()-_\n") for c in text)
    assert plain >= 0.9 * len(text), text
    # Mostly words the docs use: the model learned words, not byte noise.
    known = set(re.findall(r"[a-z]+", demo_model.training_text().lower()))
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 10, text
    assert sum(w in known for w in words) >= 0.9 * len(words), text


def test_builds_are_byte_identical(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    demo_model.build_demo_model(first, TINY_PLAN)
    demo_model.build_demo_model(second, TINY_PLAN)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_build_restores_torch_threads_and_rng(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    demo_model.build_demo_model(tmp_path, TINY_PLAN)
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.rand(2), expected)


def test_racing_builders_both_get_the_one_complete_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo_model, "PLAN", TINY_PLAN)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(demo_model.ensure_demo_model(tmp_path)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = tmp_path / demo_model.DIR_NAME
    assert results == [final, final]
    assert (final / demo_model.MARKER).is_file()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [final.name]


def test_a_build_that_lost_the_rename_race_uses_the_winner(tmp_path: Path) -> None:
    final = tmp_path / "final"
    final.mkdir()
    (final / demo_model.MARKER).write_text("{}")
    (final / "model.safetensors").write_text("theirs")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "model.safetensors").write_text("ours")
    demo_model.publish(staging, final)
    assert (final / "model.safetensors").read_text() == "theirs"


def test_incomplete_directory_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_model, "PLAN", TINY_PLAN)
    debris = tmp_path / demo_model.DIR_NAME
    debris.mkdir()
    (debris / "config.json").write_text("half written")
    path = demo_model.ensure_demo_model(tmp_path)
    assert (path / demo_model.MARKER).is_file()
    assert (path / "model.safetensors").is_file()


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TGIS_DEMO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_model.default_cache_root() == tmp_path / "xdg" / "tgis"
    monkeypatch.setenv("TGIS_DEMO_CACHE", str(tmp_path / "explicit"))
    assert demo_model.default_cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("TGIS_DEMO_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_model.default_cache_root() == tmp_path / "home" / ".cache" / "tgis"


def test_import_has_no_side_effects() -> None:
    import subprocess
    import sys

    code = "import sys, tgis.demo_model; print('torch' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
    assert result.stderr == ""
