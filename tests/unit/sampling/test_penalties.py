"""Tests for the HTTP APIs' OpenAI penalties in tgis.sampling: presence/frequency penalties and logit_bias.

Expected scores are computed here from OpenAI's definition:
logit - count * frequency_penalty - (count > 0) * presence_penalty, then logit_bias added.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from tgis.sampling import BatchSampler, SamplingConfig

CPU = torch.device("cpu")
VOCAB = 32
EOS = 3


def greedy(**kwargs: object) -> SamplingConfig:
    return SamplingConfig(greedy=True, **kwargs)  # type: ignore[arg-type]


def make_sampler(configs: Sequence[SamplingConfig], contexts: Sequence[Sequence[int]]) -> BatchSampler:
    sampler = BatchSampler(VOCAB, [EOS], CPU)
    sampler.add_rows(configs, contexts)
    return sampler


def logits_for(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def expected(row: torch.Tensor, generated: Sequence[int], config: SamplingConfig) -> torch.Tensor:
    out = row.clone()
    for token, count in Counter(generated).items():
        out[token] -= count * config.frequency_penalty + config.presence_penalty
    for token, bias in config.logit_bias:
        if token < VOCAB:
            out[token] += bias
    return out


def test_presence_and_frequency_penalties_follow_openai_formula_per_row_across_prune_and_append() -> None:
    configs = {
        "a": greedy(presence_penalty=0.7, frequency_penalty=0.0),
        "b": greedy(presence_penalty=0.0, frequency_penalty=1.3),
        "c": greedy(),
        "d": greedy(presence_penalty=-0.5, frequency_penalty=0.4),
    }
    order = ["a", "b", "c"]
    # Prompt tokens are not counted: only generated ones.
    sampler = make_sampler([configs[n] for n in order], [[5, 6], [7], [8]])
    generated: dict[str, list[int]] = {n: [] for n in configs}

    def step(seed: int) -> None:
        logits = logits_for(len(order), seed)
        # Feed back tokens that repeat, so counts exceed one.
        logits[:, 10] += 100.0 if seed % 2 else 0.0
        processed = sampler.process(logits)
        for i, name in enumerate(order):
            want = expected(logits[i], generated[name], configs[name])
            torch.testing.assert_close(processed[i], want, rtol=0, atol=1e-5)
        for name, token in zip(order, sampler.sample(logits).token_ids, strict=True):
            generated[name].append(token)

    for seed in range(1, 6):
        step(seed)
    assert any(Counter(generated["b"])[t] > 1 for t in generated["b"]), "a count above one was exercised"
    sampler.keep_rows([2, 0])
    order = ["c", "a"]
    step(7)
    sampler.add_rows([configs["d"]], [[10, 10]])
    order = ["c", "a", "d"]
    for seed in range(8, 12):
        step(seed)


def test_counts_dropped_when_no_row_needs_them_then_rebuilt_from_zero() -> None:
    sampler = make_sampler([greedy(frequency_penalty=2.0), greedy()], [[], []])
    for seed in range(3):
        sampler.sample(logits_for(2, seed))
    sampler.keep_rows([1])
    sampler.add_rows([greedy(frequency_penalty=2.0)], [[]])
    logits = logits_for(2, 9)
    processed = sampler.process(logits)
    assert torch.equal(processed[0], logits[0])
    assert torch.equal(processed[1], logits[1])  # new row: nothing generated yet


def test_logit_bias_is_added_per_row_and_out_of_vocab_ids_are_dropped() -> None:
    biased = greedy(logit_bias=((1, 5.0), (2, -2.5), (VOCAB + 4, 9.0)))
    sampler = make_sampler([biased, greedy()], [[], []])
    logits = logits_for(2, 4)
    processed = sampler.process(logits)
    torch.testing.assert_close(processed[0], expected(logits[0], [], biased), rtol=0, atol=0)
    assert torch.equal(processed[1], logits[1])


def test_logit_bias_bans_and_forces_tokens_in_greedy_choice() -> None:
    logits = logits_for(2, 5)
    top = int(logits[0].argmax())
    sampler = make_sampler([greedy(logit_bias=((top, -100.0),)), greedy(logit_bias=((17, 100.0),))], [[], []])
    tokens = sampler.sample(logits).token_ids
    assert tokens[0] != top
    assert tokens[1] == 17


def test_penalties_and_bias_combine() -> None:
    config = greedy(presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((4, 3.0),))
    sampler = make_sampler([config], [[]])
    generated: list[int] = []
    for seed in range(6):
        logits = logits_for(1, seed)
        logits[0, 4] += 6.0
        torch.testing.assert_close(
            sampler.process(logits)[0], expected(logits[0], generated, config), atol=1e-5, rtol=0
        )
        generated += sampler.sample(logits).token_ids
    assert generated.count(4) >= 1


def test_negative_logit_bias_id_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias ids must be >= 0"):
        greedy(logit_bias=((-1, 1.0),))
    assert greedy(logit_bias=((0, 1.0),)).logit_bias == ((0, 1.0),)
