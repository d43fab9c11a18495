"""Distilling a speculator from a tiny model: transcripts, example alignment, the acceptance metric,
determinism, and that training beats random weights; plus the random-speculator fixture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engines.common import lm_head_inputs
from engines.speculative import MLPSpeculator, MLPSpeculatorConfig, load_mlp_speculator
from engines.speculative.train import (
    Acceptance,
    DistillPlan,
    Transcript,
    distillation_examples,
    greedy_transcripts,
    measure_acceptance,
    train_speculator,
)
from tests.fixtures.speculator import FIT_PLAN, write_fitted_speculator, write_random_speculator
from tests.fixtures.tiny import corpus_lines, train_tokenizer


@pytest.fixture(scope="module")
def gpt2(model_dirs: Callable[[str], Path]) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dirs("gpt2")).eval()


def corpus_prompts(length: int, count: int, offset: int = 0) -> torch.Tensor:
    ids = train_tokenizer("gpt2").encode("\n".join(corpus_lines())).ids
    windows = torch.tensor(ids).unfold(0, length, length)
    return windows[offset : offset + count]


def test_greedy_transcripts_are_what_the_model_computes(gpt2: PreTrainedModel) -> None:
    prompts = corpus_prompts(8, 3)
    transcript = greedy_transcripts(gpt2, prompts, new_tokens=6, batch_size=2)
    assert transcript.tokens.shape == (3, 14)
    assert transcript.hidden.shape == (3, 13, gpt2.config.hidden_size)
    generating: Any = gpt2  # transformers' stubs type generate() as a tensor attribute
    expected = generating.generate(
        input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6, do_sample=False
    )
    assert torch.equal(transcript.tokens, expected)
    # After the prompt, each greedy token is the next token of the transcript.
    assert torch.equal(transcript.greedy[:, 7:], transcript.tokens[:, 8:])
    with torch.inference_mode(), lm_head_inputs(gpt2) as seen:
        logits = gpt2(input_ids=transcript.tokens).logits
    torch.testing.assert_close(transcript.hidden, seen[0][:, :-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(transcript.greedy, logits[:, :-1].argmax(-1))


def test_examples_feed_head_i_the_token_after_t_plus_i_and_ask_for_the_greedy_next() -> None:
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    hidden = torch.arange(5.0).view(1, 5, 1).expand(1, 5, 2)  # the state at position t is [t, t]
    greedy = torch.tensor([[21, 22, 23, 24, 25]])  # greedy[t]: the model's token for position t+1
    examples = distillation_examples(Transcript(tokens, hidden, greedy, prompt_length=2), n_predict=2)
    states, chain, targets = examples
    assert states[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert chain.tolist() == [[11, 12], [12, 13], [13, 14]]
    assert targets.tolist() == [[22, 23], [23, 24], [24, 25]]


def test_acceptance_counts_positions_and_leading_matches() -> None:
    matches = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    acceptance = Acceptance.from_matches(matches)
    assert acceptance.per_position == (0.75, 0.75, 0.75)
    assert acceptance.mean_accepted == (2 + 1 + 0 + 3) / 4
    assert acceptance.overall == 0.75
    assert acceptance.steps == 4


def test_training_is_deterministic_and_learns_the_targets_continuations(
    gpt2: PreTrainedModel, model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    # The tiny model's weights are random, so there is nothing to generalise; what training can show
    # is that the heads learn the continuations they were shown, aligned as decoding meets them.
    prompts = corpus_prompts(16, 48)
    first = write_fitted_speculator(tmp_path / "a", model_dirs("gpt2"), prompts)
    second = write_fitted_speculator(tmp_path / "b", model_dirs("gpt2"), prompts)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()

    new_tokens = FIT_PLAN.new_tokens
    fitted = measure_acceptance(gpt2, load_mlp_speculator(first), prompts, new_tokens, k=3)
    random = load_mlp_speculator(write_random_speculator(tmp_path / "r", model_dirs("gpt2")))
    untrained = measure_acceptance(gpt2, random, prompts, new_tokens, k=3)
    assert min(fitted.per_position) >= 0.5, fitted
    assert fitted.mean_accepted >= 1.5, fitted
    assert untrained.overall < 0.05, untrained
    elsewhere = measure_acceptance(gpt2, load_mlp_speculator(first), corpus_prompts(16, 16, offset=48), 24, 3)
    assert elsewhere.overall < fitted.overall - 0.3, (elsewhere, fitted)


def test_training_refuses_a_config_of_another_width(gpt2: PreTrainedModel) -> None:
    hidden = gpt2.config.hidden_size
    config = MLPSpeculatorConfig(vocab_size=gpt2.config.vocab_size, emb_dim=hidden * 2, n_predict=3)
    with pytest.raises(ValueError, match=f"hidden size is {hidden}"):
        train_speculator(gpt2, corpus_prompts(16, 2), config, DistillPlan(steps=1, new_tokens=4))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "bloom"])
def test_random_speculator_fixture_fits_its_target(
    arch: str, model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    target_dir = model_dirs(arch)
    path = write_random_speculator(tmp_path / "a", target_dir)
    speculator = load_mlp_speculator(path)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    assert speculator.config.vocab_size == target.config.vocab_size
    assert speculator.config.n_predict == 3
    transcript = greedy_transcripts(target, corpus_prompts(8, 4), new_tokens=2)
    proposed = speculator.propose(transcript.hidden[:, -1], transcript.tokens[:, -1], 3)
    assert proposed.shape == (4, 3)
    assert int(proposed.max()) < target.config.vocab_size
    again = write_random_speculator(tmp_path / "b", target_dir)
    other = write_random_speculator(tmp_path / "c", target_dir, seed=1)
    weights = (path / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights


def test_random_speculator_leaves_the_global_rng_alone(
    model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    write_random_speculator(tmp_path, model_dirs("gpt2"))
    assert torch.equal(torch.rand(2), expected)
    assert isinstance(load_mlp_speculator(tmp_path), MLPSpeculator)
