"""The demo speculator: an MLP speculator distilled from the demo model on first use, cached beside it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tgis import demo_model

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from engines.speculative.train import Acceptance, DistillPlan

logger = logging.getLogger(__name__)

VERSION = "v1"
DIR_NAME = f"{demo_model.DIR_NAME}-mlp-speculator-{VERSION}"
# Every HELD_OUT_EVERY-th document of the demo text is kept out of the speculator's training, so that
# acceptance is measured on text it has not seen (the demo model itself was trained on all of it).
HELD_OUT_EVERY = 8


@dataclass(frozen=True)
class SpeculatorPlan:
    """Everything that determines the demo speculator's weights; change it only together with VERSION."""

    # Tuned on held-out text for a build of about 30 s: more prompts and longer continuations raised
    # acceptance more than a wider inner_dim or more steps did. A fourth head matches less often than
    # the third, but for the same training time as three heads with 800 steps it raised the tokens
    # accepted a step from 1.56 to 1.90.
    n_predict: int = 4
    inner_dim: int = 128
    prompt_tokens: int = 32
    prompt_stride: int = 16  # tokens between the starts of consecutive training prompts
    new_tokens: int = 96  # greedy continuation of each prompt; with it, the demo model's whole context
    steps: int = 600
    lr: float = 2e-2
    batch_size: int = 512
    seed: int = 0

    def distill_plan(self) -> DistillPlan:
        from engines.speculative.train import DistillPlan

        return DistillPlan(
            steps=self.steps,
            lr=self.lr,
            batch_size=self.batch_size,
            new_tokens=self.new_tokens,
            seed=self.seed,
            threads=demo_model.PLAN.threads,
        )


PLAN = SpeculatorPlan()


def ensure_demo_speculator(cache_root: Path | None = None) -> Path:
    """The demo speculator directory (building the demo model and then the speculator if not cached)."""
    root = cache_root or demo_model.default_cache_root()
    model_dir = demo_model.ensure_demo_model(root)
    return demo_model.ensure_built(
        root / DIR_NAME,
        lambda out_dir: build_demo_speculator(out_dir, model_dir),
        what="the demo speculator",
        duration="about 30 s on 2 idle cores",
        version=VERSION,
        log=logger,
    )


def build_demo_speculator(out_dir: Path, model_dir: Path, plan: SpeculatorPlan | None = None) -> None:
    """Distil a speculator from the demo model in `model_dir` into `out_dir` (no caching here)."""
    from engines.speculative import MLPSpeculatorConfig, save_mlp_speculator
    from engines.speculative.train import train_speculator

    plan = plan or PLAN
    target = load_target(model_dir)
    prompts = token_windows(corpus_ids(model_dir, held_out=False), plan.prompt_tokens, plan.prompt_stride)
    config = MLPSpeculatorConfig(
        vocab_size=target.config.vocab_size,
        emb_dim=target.config.hidden_size,
        inner_dim=plan.inner_dim,
        n_predict=plan.n_predict,
    )
    with demo_model.quiet_transformers():
        speculator = train_speculator(target, prompts, config, plan.distill_plan())
    save_mlp_speculator(speculator, config, out_dir)


def load_target(model_dir: Path) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    with demo_model.quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def split_documents() -> tuple[list[str], list[str]]:
    """The demo text's documents for training the speculator, and those held out from it.

    The Python docs repeat some topics and many paragraphs verbatim, so the training documents lose every
    paragraph that a held-out document has.
    """
    documents = list(dict.fromkeys(demo_model.training_documents()))
    held_out = documents[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY]
    held_out_paragraphs = {paragraph for document in held_out for paragraph in document.split("\n")}
    training = []
    for index, document in enumerate(documents):
        if index % HELD_OUT_EVERY != HELD_OUT_EVERY - 1:
            kept = [paragraph for paragraph in document.split("\n") if paragraph not in held_out_paragraphs]
            training.append("\n".join(kept))
    return [document for document in training if document], held_out


def corpus_ids(model_dir: Path, *, held_out: bool) -> torch.Tensor:
    """The token ids of the training or the held-out documents, joined by EOS as the demo model saw them."""
    import torch
    from tokenizers import Tokenizer

    documents = split_documents()[1 if held_out else 0]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return torch.tensor(tokenizer.encode(demo_model.EOS.join(documents)).ids, dtype=torch.long)


def token_windows(ids: torch.Tensor, length: int, stride: int) -> torch.Tensor:
    """[N, length] windows of `ids` starting every `stride` tokens."""
    return ids.unfold(0, length, stride).contiguous()


def held_out_acceptance(
    speculator_dir: Path, model_dir: Path, *, prompts: int = 64, new_tokens: int = 64, k: int | None = None
) -> Acceptance:
    """How often the speculator's first k proposals (all of them by default) match the demo model's
    greedy decoding, over `new_tokens` steps after each of `prompts` prompts from held-out text."""
    from engines.common import fixed_threads
    from engines.speculative import load_mlp_speculator
    from engines.speculative.train import measure_acceptance

    speculator = load_mlp_speculator(speculator_dir)
    held_out = corpus_ids(model_dir, held_out=True)
    # Spread the prompts over the whole held-out text.
    stride = max(1, (len(held_out) - PLAN.prompt_tokens) // prompts)
    windows = token_windows(held_out, PLAN.prompt_tokens, stride)[:prompts]
    with fixed_threads(demo_model.PLAN.threads), demo_model.quiet_transformers():
        target = load_target(model_dir)
        return measure_acceptance(target, speculator, windows, new_tokens, k or speculator.config.n_predict)
