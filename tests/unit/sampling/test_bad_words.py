"""vLLM's bad_words: token sequences a row never completes, in the vectorised sampler."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import NoBadWordsLogitsProcessor

from tgis.sampling import BatchSampler, SamplingConfig
from tgis.sampling.bad_words import BadWordRows, completing_ids, word_sequences

VOCAB = 32
CPU = torch.device("cpu")


def test_a_word_is_banned_as_written_and_after_a_space_each_sequence_once() -> None:
    encode = {"fox": [5], " fox": [9, 5], "big cat": [7, 8], " big cat": [7, 8]}.__getitem__
    assert word_sequences(["fox", "  big cat"], encode) == ((5,), (9, 5), (7, 8))
    with pytest.raises(ValueError, match="must not be empty"):
        word_sequences(["fox", "  "], encode)


@pytest.mark.parametrize(
    ("context", "expected"),
    [((), [4]), ((1, 2), [4, 3]), ((2,), [4]), ((9, 1, 2), [4, 3]), ((1, 2, 6), [4, 7])],
)
def test_the_last_token_is_banned_wherever_the_sequence_would_complete(context, expected) -> None:
    assert completing_ids(context, ((4,), (1, 2, 3), (6, 7))) == expected


def test_rows_follow_the_batch_through_keep_and_extend() -> None:
    rows = BadWordRows()
    rows.append([((1, 2),), ()], [[0, 1], [1]])
    other = BadWordRows()
    other.append([((3, 4),)], [[3]])
    rows.extend(other)
    rows.keep([2, 0])  # the extended row first, the row without bad words gone
    scores = rows.mask(torch.zeros(2, VOCAB))
    assert scores[0, 4] == float("-inf") and scores[1, 2] == float("-inf")
    assert int(torch.isinf(scores).sum()) == 2
    rows.advance([9, 5], None)
    assert not torch.isinf(rows.mask(torch.zeros(2, VOCAB))).any()


def test_greedy_and_sampled_rows_never_complete_a_banned_sequence_and_equal_transformers() -> None:
    torch.manual_seed(0)
    banned = ((5,), (7, 8), (2, 3, 4))
    greedy = SamplingConfig(greedy=True, bad_words=banned)
    sampled = SamplingConfig(greedy=False, temperature=1.5, seed=11, bad_words=banned)
    sampler = BatchSampler(VOCAB, [0], CPU)
    contexts = [[2, 3], [7]]
    sampler.add_rows([greedy, sampled], contexts)
    history = [list(c) for c in contexts]
    reference = NoBadWordsLogitsProcessor([list(s) for s in banned], eos_token_id=[0])
    for _ in range(40):
        logits = torch.randn(2, VOCAB)
        # Favour the banned completions, so that only the ban keeps them out.
        logits[:, [4, 5, 8]] += 6.0
        expected_greedy = reference(torch.tensor([history[0]]), logits[:1].clone()).argmax(-1)
        step = sampler.sample(logits)
        assert step.token_ids[0] == int(expected_greedy)
        for row, token in enumerate(step.token_ids):
            history[row].append(token)
    for generated, context in zip(history, contexts, strict=True):
        text = tuple(generated)
        for sequence in banned:
            n = len(sequence)  # every window that ends on a generated token
            starts = range(max(len(context) - n + 1, 0), len(text) - n + 1)
            assert all(text[i : i + n] != sequence for i in starts)
    assert not sampler.chooses_ahead  # a bad-word row's scores depend on its earlier tokens
