"""The llama-family benchmark tokenizer: a 32000-token byte-level BPE trained locally, built once, cached."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tgis.demo_model import EOS as DEMO_EOS
from tgis.demo_model import MARKER, build_lock, default_cache_root, make_readable, publish, training_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

VERSION = "v1"
DIR_NAME = f"bench-bpe32k-{VERSION}"
VOCAB_SIZE = 32000  # Llama 2's and TinyLlama's, so the output matrix has their size
UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2 as in Llama's tokenizer
# Parts of the standard library that are not its own source text (vendored, generated, tests).
_SKIPPED_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


def ensure_bench_tokenizer(cache_root: Path | None = None) -> Path:
    """The tokenizer directory, training it first (a few seconds) if no complete copy is cached."""
    final = (cache_root or default_cache_root()) / DIR_NAME
    if (final / MARKER).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(final):
        if not (final / MARKER).exists():
            _build_and_publish(final)
    return final


def _build_and_publish(final: Path) -> None:
    logger.info(f"Training the {VOCAB_SIZE}-token benchmark tokenizer at {final}")
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        digest = build_bench_tokenizer(staging)
        make_readable(staging)
        elapsed = time.perf_counter() - started
        marker = {"version": VERSION, "tokenizer_sha256": digest, "build_seconds": round(elapsed, 1)}
        (staging / MARKER).write_text(json.dumps(marker))
        publish(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(f"Trained the benchmark tokenizer at {final} in {elapsed:.1f}s")


def build_bench_tokenizer(out_dir: Path) -> str:
    """Train and save the tokenizer into `out_dir`; returns the SHA-256 of its tokenizer.json."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_tokenizer(corpus())
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=EOS
    )
    wrapped.save_pretrained(out_dir)
    return hashlib.sha256((out_dir / "tokenizer.json").read_bytes()).hexdigest()


def corpus() -> list[str]:
    """The demo model's prose (the Python documentation), then the standard library's own source files.

    The prose alone holds too few distinct words for 32000 tokens; the sources add identifiers and
    comments. Both ship with the interpreter, so the tokenizer is the same wherever the same Python
    builds it (another Python version may merge differently; the marker records the file's hash).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(
        path
        for path in stdlib.rglob("*.py")
        if not _SKIPPED_PARTS.intersection(path.relative_to(stdlib).parts)
    )
    prose = training_text().split(DEMO_EOS)
    return [*prose, *(path.read_text(encoding="utf-8", errors="replace") for path in sources)]


def train_tokenizer(documents: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE whose encodings start with BOS, as Llama's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"the local corpus yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}: "
            "is the Python standard library's source missing?"
        )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    return tokenizer
