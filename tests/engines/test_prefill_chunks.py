"""A prefill group of mixed lengths runs as several low-padding passes, merged back in the given order."""

from __future__ import annotations

import torch

from engines.base import EngineConfig, PrefillRow
from engines.hf_transformers import (
    PREFILL_CHUNK_MAX_PADDING,
    PREFILL_CHUNK_MAX_POSITIONS,
    load_padded,
    prefill_chunks,
)
from tests.engines.driver import Run, reference_greedy


def test_a_group_that_pads_little_stays_one_pass_in_its_order():
    assert prefill_chunks([10, 9, 10, 9]) == [[0, 1, 2, 3]]
    assert prefill_chunks([7]) == [[0]]


def test_mixed_lengths_are_cut_into_sorted_passes_within_the_limits():
    lengths = [100, 5, 98, 6, 50, 7, 52, 101]
    chunks = prefill_chunks(lengths)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(lengths)))
    for chunk in chunks:
        longest = max(lengths[i] for i in chunk)
        positions = longest * len(chunk)
        assert positions <= PREFILL_CHUNK_MAX_POSITIONS or len(chunk) == 1
        assert (positions - sum(lengths[i] for i in chunk)) / positions <= PREFILL_CHUNK_MAX_PADDING
    assert [sorted(lengths[i] for i in chunk) for chunk in chunks] == [[5, 6, 7], [50, 52], [98, 100, 101]]


def test_chunked_prefill_answers_in_the_given_order_like_one_row_at_a_time(model_dirs):
    model_dir = model_dirs("llama")
    engine = load_padded(EngineConfig(model_path=model_dir))
    prompts = {
        "long": tuple(range(5, 65)),
        "short": (7, 8),
        "middle": tuple(range(100, 130)),
        "tiny": (9,),
        "long2": tuple(range(200, 262)),
    }
    assert len(prefill_chunks([len(ids) for ids in prompts.values()])) > 1  # the test must chunk
    run = Run(engine, frozenset(engine.spec.eos_token_ids))
    run.join({"first": (3, 4, 5)})  # rows already running stay in front
    result = engine.prefill([PrefillRow(ids, want_prompt_logits=True) for ids in prompts.values()])
    assert [None if p is None else p.shape[0] for p in result.prompt_logits] == [
        len(ids) for ids in prompts.values()
    ]
    solo = load_padded(EngineConfig(model_path=model_dir))
    for logits, (name, ids) in zip(result.next_token_logits, prompts.items(), strict=True):
        expected = solo.prefill([PrefillRow(ids)]).next_token_logits[0]
        solo.clear()
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=name)
    run.names += list(prompts)
    run._take(list(prompts), result.next_token_logits)
    run.finish()
    for name, ids in [("first", (3, 4, 5)), *prompts.items()]:
        assert tuple(run.tokens[name]) == reference_greedy(model_dir, ids), name
