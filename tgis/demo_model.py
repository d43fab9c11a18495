"""The built-in demo model: trained locally and deterministically on first use, then reused from a cache."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel

logger = logging.getLogger(__name__)

VERSION = "v1"
DIR_NAME = f"demo-gpt2-{VERSION}"
MARKER = "BUILD_COMPLETE"  # written last, so its presence means the directory is whole
EOS = "<|endoftext|>"
SEED = 20240611


@dataclass(frozen=True)
class TrainPlan:
    """Everything that determines the demo weights; change it only together with VERSION."""

    vocab_size: int = 2048
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    context: int = 128
    batch_size: int = 16
    steps: int = 250
    peak_lr: float = 3e-3
    warmup_steps: int = 10
    threads: int = 2


PLAN = TrainPlan()


def default_cache_root() -> Path:
    """$TGIS_DEMO_CACHE, else $XDG_CACHE_HOME/tgis, else ~/.cache/tgis."""
    if explicit := os.environ.get("TGIS_DEMO_CACHE"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tgis"


def ensure_demo_model(cache_root: Path | None = None) -> Path:
    """The demo model directory, building it first if no complete copy is cached."""
    final = (cache_root or default_cache_root()) / DIR_NAME
    return ensure_built(
        final, build_demo_model, what="the demo model", duration="about 30 s on 2 idle cores", version=VERSION
    )


def ensure_built(
    final: Path,
    build: Callable[[Path], None],
    *,
    what: str,
    duration: str,
    version: str,
    log: logging.Logger = logger,
) -> Path:
    """`final`, first building it once with `build(staging)` and publishing it whole if no complete copy
    is there; `what` and `duration` are for the log, `version` for the marker."""
    if (final / MARKER).exists():
        log.info(f"Using {what} at {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(final):
        # Another process may have finished while this one waited for the lock.
        if (final / MARKER).exists():
            log.info(f"Using {what} at {final}")
            return final
        log.info(f"Building {what} at {final} (once; {duration})")
        elapsed = _build_and_publish(final, build, version)
        log.info(f"Built {what} at {final} in {elapsed:.1f}s")
    return final


@contextlib.contextmanager
def build_lock(final: Path) -> Iterator[None]:
    # Saves a second process from training too; the atomic rename alone would keep it correct.
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(final.parent / f".{final.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_and_publish(final: Path, build: Callable[[Path], None], version: str) -> float:
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(staging)
        make_readable(staging)
        elapsed = time.perf_counter() - started
        (staging / MARKER).write_text(json.dumps({"version": version, "build_seconds": round(elapsed, 1)}))
        publish(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return elapsed


def make_readable(directory: Path) -> None:
    # mkdtemp makes the directory private and transformers 5 writes model.safetensors 0600;
    # the cache may be shared with other users of the machine.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def publish(staging: Path, final: Path) -> None:
    if final.exists() and not (final / MARKER).exists():
        shutil.rmtree(final)  # debris from an interrupted copy by hand; our renames are whole
    try:
        os.rename(staging, final)
    except OSError:
        if not (final / MARKER).exists():
            raise
        # Lost a race to a process that published first: its identical build wins.


def build_demo_model(out_dir: Path, plan: TrainPlan | None = None) -> None:
    """Train the tokenizer and the model into `out_dir` (the slow part; no caching here)."""
    import torch

    plan = plan or PLAN
    text = training_text()
    tokenizer = _train_tokenizer(text, plan.vocab_size)
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    _save_tokenizer(tokenizer, plan.context, out_dir)
    eos_id = tokenizer.token_to_id(EOS)
    assert eos_id is not None  # trainers always add their special tokens
    with quiet_transformers():
        model = _train_model(ids, tokenizer.get_vocab_size(), eos_id, plan)
        model.save_pretrained(out_dir)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    # save_pretrained draws a tqdm bar on stderr; this module only logs.
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def training_text() -> str:
    """English prose from the Python docs bundled with the interpreter, documents split by EOS."""
    return EOS.join(training_documents())


def training_documents() -> list[str]:
    """The non-empty prose documents of the training text, in order."""
    documents = [_prose(doc) for doc in _source_documents()]
    return [doc for doc in documents if doc]


def _source_documents() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; stdlib docstrings still ship
        return _stdlib_docstrings()
    return [topics[key] for key in sorted(topics)]


def _stdlib_docstrings() -> list[str]:
    import importlib
    import inspect

    names = (
        "argparse",
        "asyncio",
        "collections",
        "dataclasses",
        "decimal",
        "email",
        "functools",
        "json",
        "logging",
        "pathlib",
        "re",
        "string",
        "subprocess",
        "threading",
        "typing",
        "unittest",
    )
    docs: list[str] = []
    for name in names:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            doc = getattr(getattr(module, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                docs.append(inspect.cleandoc(doc))  # else indented lines would read as code
    return docs


_CODE_OR_RULE = re.compile(r"^(\s{3,}|[*=\-~^]{3,}|>>>|\.\.\.)")
# Quotes around code names, *emphasis* and [1] footnote marks: noise for a tiny model.
_MARKUP = re.compile(r"[\"*“”]|\[\d+\]")


def _prose(document: str) -> str:
    # Keep flowing paragraphs, drop indented code, grammar productions and heading underlines.
    paragraphs = []
    for block in re.split(r"\n\s*\n", document):
        lines = [line for line in block.splitlines() if not _CODE_OR_RULE.match(line)]
        paragraph = _MARKUP.sub("", " ".join(line.strip().removeprefix("* ") for line in lines))
        paragraph = re.sub(r"\s+", " ", paragraph).strip()
        if len(paragraph) >= 40 and _letter_share(paragraph) >= 0.8:
            paragraphs.append(paragraph)
    return "\n".join(paragraphs)


def _letter_share(text: str) -> float:
    return sum(c.isalpha() or c == " " for c in text) / len(text)


def _train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.split(EOS), trainer)
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, context: int, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,
        model_max_length=context,
    )
    wrapped.save_pretrained(out_dir)


def _train_model(ids: torch.Tensor, vocab_size: int, eos_id: int, plan: TrainPlan) -> GPT2LMHeadModel:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from engines.common import fixed_threads

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=plan.context,
        n_embd=plan.hidden,
        n_layer=plan.layers,
        n_head=plan.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,  # the bigram start needs different input and output rows
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    with fixed_threads(plan.threads), torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(config)
        _start_from_bigrams(model, ids, plan)
        _fit(model, ids, plan)
    return model.eval()


def _start_from_bigrams(model: GPT2LMHeadModel, ids: torch.Tensor, plan: TrainPlan) -> None:
    """Set wte/lm_head to a rank-(hidden-1) factorisation of log P(next | token).

    From random weights a few hundred CPU steps only reach word salad; starting as a bigram
    model (loss ~4.8 before any step) lets the same steps learn phrases instead.
    """
    import torch

    vocab, hidden = model.config.vocab_size, plan.hidden
    counts = torch.zeros(vocab, vocab)
    counts.index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1), accumulate=True)
    smoothed = counts + 0.1
    log_p = (smoothed / smoothed.sum(1, keepdim=True)).log()
    u, s, v = torch.svd_lowrank(log_p - log_p.mean(1, keepdim=True), q=hidden + 16, niter=4)
    # LayerNorm removes each row's mean over dims: use only directions orthogonal to all-ones.
    basis = _zero_mean_basis(hidden)
    root_s = s[: hidden - 1].sqrt()
    inputs = (u[:, : hidden - 1] * root_s) @ basis.T
    outputs = (v[:, : hidden - 1] * root_s) @ basis.T
    norms = inputs.norm(dim=1, keepdim=True).clamp_min(1e-6)
    with torch.no_grad():
        # Unit-variance rows pass through ln_f unchanged, so logits ≈ the factorised log-probs.
        model.transformer.wte.weight.copy_(inputs / norms * hidden**0.5)
        model.lm_head.weight.copy_(outputs * (norms.mean() / hidden**0.5))
        model.lm_head.weight.mul_(_best_logit_scale(model, ids, plan))


def _zero_mean_basis(dim: int) -> torch.Tensor:
    import torch

    columns = torch.cat([torch.ones(dim, 1), torch.eye(dim)[:, : dim - 1]], dim=1)
    q, _ = torch.linalg.qr(columns)
    return q[:, 1:]


def _best_logit_scale(model: GPT2LMHeadModel, ids: torch.Tensor, plan: TrainPlan) -> float:
    # Smoothing and truncation leave the factorised logits too flat; pick the sharpening
    # that fits a fixed sample of the text best.
    import torch

    stride = (len(ids) - plan.context) // plan.batch_size
    batch = torch.stack([ids[i * stride : i * stride + plan.context] for i in range(plan.batch_size)])
    weight = model.lm_head.weight.detach().clone()
    losses: dict[float, float] = {}
    with torch.no_grad():
        for scale in (2.0, 3.0, 4.0, 5.0, 6.0):
            model.lm_head.weight.copy_(weight * scale)
            losses[scale] = _loss(model, batch).item()
        model.lm_head.weight.copy_(weight)
    return min(losses, key=lambda scale: losses[scale])


def _fit(model: GPT2LMHeadModel, ids: torch.Tensor, plan: TrainPlan) -> None:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.peak_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, plan))
    batches = torch.Generator().manual_seed(SEED)
    model.train()
    for _ in range(plan.steps):
        starts = torch.randint(0, len(ids) - plan.context, (plan.batch_size,), generator=batches)
        batch = torch.stack([ids[s : s + plan.context] for s in starts.tolist()])
        loss = _loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()


def _loss(model: GPT2LMHeadModel, batch: torch.Tensor) -> torch.Tensor:
    # Computed here rather than via labels=: transformers 5 warns that GPT-2's loss_type is unset.
    import torch

    logits = model(input_ids=batch).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _lr_factor(step: int, plan: TrainPlan) -> float:
    if step < plan.warmup_steps:
        return (step + 1) / plan.warmup_steps
    progress = (step - plan.warmup_steps) / max(1, plan.steps - plan.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
