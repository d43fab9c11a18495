"""Session fixtures: tiny random-weight models and byte-level BPE tokenizers, built locally."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.fixtures.tiny import build_model, build_tokenizer
from tests.launcher import Launched

# Served models run in float32 unless a test asks for another DTYPE: the reference generations are
# float32, and on CPUs with native bf16 the server's default would be bfloat16.
os.environ.setdefault("DTYPE", "float32")


@pytest.fixture(autouse=True)
def _gil_switch_interval_restored() -> Iterator[None]:
    """An in-process server whose steps are whole compiled graphs shortens Python's GIL switch interval
    for its process (tgis/openmp.py); the tests after it start from what the process had."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`model_dirs(arch)` → a directory holding that tiny model and its tokenizer, built once."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_model(tmp_path_factory.mktemp(f"model-{arch}"), arch)  # type: ignore[arg-type]
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tokenizer_dir_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the gpt2-style tokenizer files."""
    return build_tokenizer(tmp_path_factory.mktemp("tok-gpt2"), "gpt2")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir_gpt2: Path) -> PreTrainedTokenizerBase:
    """The gpt2-style byte-level BPE tokenizer (no specials added on encode)."""
    return AutoTokenizer.from_pretrained(tokenizer_dir_gpt2)


@pytest.fixture(scope="session")
def llama_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    """The llama-style tokenizer: adds BOS on encode."""
    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok-llama"), "llama"))


@pytest.fixture
def launched() -> Iterator[Callable[..., Launched]]:
    """`launched(env, *args)` starts a `text-generation-launcher`, killed at teardown if still running."""
    started: list[Launched] = []

    def launch(env: dict[str, str], *args: str) -> Launched:
        started.append(Launched(env, *args))
        return started[-1]

    yield launch
    for run in started:
        run.kill()
