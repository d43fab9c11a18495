"""Tests for tgis.sampling: the SPEC §2.2 pipeline, seeded sampling and §2.5 token details."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgis.sampling import BatchSampler, SamplingConfig, StepSample, prompt_token_details
from tgis.types import (
    DecodingMethod,
    GenerationParams,
    LengthPenalty,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    TopToken,
)

CPU = torch.device("cpu")
VOCAB = 64
EOS = 3
NO_IDS = torch.zeros(1, 0, dtype=torch.long)


def sampling(**kwargs: object) -> SamplingConfig:
    return SamplingConfig(greedy=False, **kwargs)  # type: ignore[arg-type]


def greedy(**kwargs: object) -> SamplingConfig:
    return SamplingConfig(greedy=True, **kwargs)  # type: ignore[arg-type]


def make_sampler(
    configs: Sequence[SamplingConfig], contexts: Sequence[Sequence[int]] | None = None, vocab: int = VOCAB
) -> BatchSampler:
    sampler = BatchSampler(vocab, [EOS], CPU)
    sampler.add_rows(configs, contexts if contexts is not None else [[] for _ in configs])
    return sampler


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3


def hf_expected(row: torch.Tensor, context: Sequence[int], *processors: LogitsProcessor) -> torch.Tensor:
    scores = row.unsqueeze(0).clone()
    ids = torch.tensor([list(context)], dtype=torch.long) if context else NO_IDS
    for processor in processors:
        scores = processor(ids, scores)
    return scores.squeeze(0)


def assert_rows_match(actual: torch.Tensor, expected: Sequence[torch.Tensor]) -> None:
    for i, row in enumerate(expected):
        assert torch.equal(actual[i], row), f"row {i} differs"


# --- processors against transformers, per row, mixed parameters in one batch -----------------------


def test_temperature_matches_transformers_per_row() -> None:
    temps = [0.05, 0.7, 1.0, 1.9]
    logits = random_logits(len(temps))
    actual = make_sampler([sampling(temperature=t) for t in temps]).process(logits)
    expected = [hf_expected(logits[i], [], TemperatureLogitsWarper(t)) for i, t in enumerate(temps)]
    assert_rows_match(actual, expected)


def test_top_k_matches_transformers_per_row_and_clamps_to_vocab() -> None:
    ks = [1, 5, 0, 17, VOCAB, VOCAB + 100]
    logits = random_logits(len(ks))
    actual = make_sampler([sampling(top_k=k) for k in ks]).process(logits)
    expected = [hf_expected(logits[i], [], TopKLogitsWarper(k)) if k else logits[i] for i, k in enumerate(ks)]
    assert_rows_match(actual, expected)
    assert torch.isfinite(actual[-1]).all()


def test_top_p_matches_transformers_per_row() -> None:
    ps = [0.1, 0.5, 1.0, 0.9, 0.999]
    logits = random_logits(len(ps))
    actual = make_sampler([sampling(top_p=p) for p in ps]).process(logits)
    expected = [hf_expected(logits[i], [], TopPLogitsWarper(p)) for i, p in enumerate(ps)]
    assert_rows_match(actual, expected)


def test_tiny_top_p_still_keeps_the_top_token() -> None:
    logits = random_logits(2)
    actual = make_sampler([sampling(top_p=1e-9), sampling(top_p=1e-9)]).process(logits)
    assert (torch.isfinite(actual).sum(dim=1) == 1).all()
    assert torch.equal(actual.argmax(dim=1), logits.argmax(dim=1))


def test_typical_p_matches_transformers_per_row_and_ignores_out_of_range() -> None:
    masses = [0.2, 0.0, 0.95, -0.5, 1.0, 0.5]
    logits = random_logits(len(masses))
    actual = make_sampler([sampling(typical_p=m) for m in masses]).process(logits)
    expected = [
        hf_expected(logits[i], [], TypicalLogitsWarper(m)) if 0 < m < 1 else logits[i]
        for i, m in enumerate(masses)
    ]
    assert_rows_match(actual, expected)


def test_repetition_penalty_matches_transformers_per_row() -> None:
    penalties = [1.3, 1.0, 0.6, 2.0]
    contexts = [[1, 2, 2, 9], [1, 2, 3], [5, 63, 0], [7]]
    logits = random_logits(len(penalties))
    configs = [greedy(repetition_penalty=p) for p in penalties]
    actual = make_sampler(configs, contexts).process(logits)
    expected = [
        hf_expected(logits[i], ctx, RepetitionPenaltyLogitsProcessor(p))
        for i, (p, ctx) in enumerate(zip(penalties, contexts, strict=True))
    ]
    assert_rows_match(actual, expected)


def test_full_pipeline_matches_transformers_chain_with_mixed_rows() -> None:
    configs = [
        sampling(temperature=0.8, top_k=10, top_p=0.9, typical_p=0.7, repetition_penalty=1.2),
        greedy(repetition_penalty=1.5, temperature=0.3, top_k=2),
        sampling(top_p=0.6),
        sampling(temperature=1.4, top_k=20, repetition_penalty=0.8),
        sampling(),
    ]
    contexts = [[4, 5, 6], [6, 7], [8], [1, 1, 2], [9]]
    logits = random_logits(len(configs), seed=3)
    actual = make_sampler(configs, contexts).process(logits)

    def chain(c: SamplingConfig) -> list[LogitsProcessor]:
        out: list[LogitsProcessor] = []
        if c.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(c.repetition_penalty))
        if not c.greedy:
            out.append(TemperatureLogitsWarper(c.temperature))
            if c.top_k:
                out.append(TopKLogitsWarper(c.top_k))
            out.append(TopPLogitsWarper(c.top_p))
            if 0 < c.typical_p < 1:
                out.append(TypicalLogitsWarper(c.typical_p))
        return out

    expected = [hf_expected(logits[i], contexts[i], *chain(c)) for i, c in enumerate(configs)]
    assert_rows_match(actual, expected)


def test_rows_without_processors_are_untouched() -> None:
    configs = [greedy(), sampling(top_k=3, temperature=0.5, repetition_penalty=1.5), sampling(), greedy()]
    logits = random_logits(len(configs))
    actual = make_sampler(configs, [[1, 2, 3]] * 4).process(logits)
    for i in (0, 2, 3):
        assert torch.equal(actual[i], logits[i])
    assert not torch.equal(actual[1], logits[1])


def test_greedy_rows_ignore_warpers_but_keep_penalties() -> None:
    logits = random_logits(1)
    sampler = make_sampler([greedy(temperature=0.2, top_k=1, top_p=0.1, repetition_penalty=2.0)], [[5]])
    expected = hf_expected(logits[0], [5], RepetitionPenaltyLogitsProcessor(2.0))
    assert torch.equal(sampler.process(logits)[0], expected)


configs_strategy = st.builds(
    SamplingConfig,
    greedy=st.booleans(),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 7, VOCAB]),
    top_p=st.sampled_from([0.3, 0.9, 1.0]),
    typical_p=st.sampled_from([0.0, 0.5, 0.95]),
    seed=st.integers(0, 2**64 - 1),
    repetition_penalty=st.sampled_from([1.0, 0.7, 1.3]),
    length_penalty=st.sampled_from([None, LengthPenalty(0, 1.5)]),
    min_new_tokens=st.integers(0, 2),
    want_logprobs=st.booleans(),
    want_ranks=st.booleans(),
    top_n=st.integers(0, 3),
)


@settings(max_examples=25, deadline=None)
@given(st.lists(configs_strategy, min_size=1, max_size=5))
def test_each_row_behaves_as_if_alone(configs: list[SamplingConfig]) -> None:
    contexts = [[(7 * i + j) % VOCAB for j in range(i + 1)] for i in range(len(configs))]
    batch = make_sampler(configs, contexts)
    alone = [make_sampler([c], [ctx]) for c, ctx in zip(configs, contexts, strict=True)]
    for step in range(3):
        logits = random_logits(len(configs), seed=step)
        together = batch.sample(logits)
        for i, sampler in enumerate(alone):
            single = sampler.sample(logits[i : i + 1])
            assert single.token_ids == [together.token_ids[i]]
            assert single.details == [together.details[i]]


# --- min tokens and length penalty -------------------------------------------------------------------


def eos_favoured_logits(rows: int = 1) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, EOS] = 5.0
    logits[:, 10] = 1.0
    return logits


def test_min_new_tokens_suppresses_eos_then_releases_it() -> None:
    sampler = make_sampler([greedy(min_new_tokens=2), greedy()])
    steps = [sampler.sample(eos_favoured_logits(2)).token_ids for _ in range(3)]
    assert steps == [[10, EOS], [10, EOS], [EOS, EOS]]


def test_min_new_tokens_suppresses_every_eos_id_only_on_its_own_rows() -> None:
    eos_ids = [EOS, 7]
    sampler = BatchSampler(VOCAB, eos_ids, CPU)
    sampler.add_rows([greedy(min_new_tokens=1), greedy(), greedy(min_new_tokens=2)], [[], [], []])
    logits = torch.zeros(3, VOCAB)
    logits[:, eos_ids] = torch.tensor([5.0, 6.0])
    scores = sampler.process(logits)
    assert scores[:, eos_ids].tolist() == [[-math.inf, -math.inf], [5.0, 6.0], [-math.inf, -math.inf]]
    assert scores[:, 10].tolist() == [0.0, 0.0, 0.0]  # no other column touched
    sampler.sample(logits, active=[0, 1])  # row 2 takes no token this time
    assert sampler.process(logits)[:, eos_ids].tolist() == [[5.0, 6.0], [5.0, 6.0], [-math.inf, -math.inf]]


def test_min_p_matches_transformers_per_row_after_temperature() -> None:
    logits = random_logits(4)
    configs = [sampling(min_p=0.05), sampling(min_p=0.5, temperature=0.7), sampling(), sampling(min_p=1.0)]
    scores = make_sampler(configs).process(logits)
    expected = [
        hf_expected(logits[0], [], MinPLogitsWarper(0.05)),
        hf_expected(logits[1], [], TemperatureLogitsWarper(0.7), MinPLogitsWarper(0.5)),
        logits[2],
        hf_expected(logits[3], [], MinPLogitsWarper(1.0)),
    ]
    assert_rows_match(scores, expected)
    assert torch.isfinite(scores[3]).sum() == 1  # min_p 1 keeps the top token alone


def test_min_p_leaves_greedy_rows_alone() -> None:
    logits = random_logits(1)
    assert torch.equal(make_sampler([greedy(min_p=0.9)]).process(logits)[0], logits[0])


def test_stop_token_ids_are_suppressed_with_eos_under_min_new_tokens_only_on_their_rows() -> None:
    sampler = make_sampler([greedy(min_new_tokens=2, stop_token_ids=(9, 11)), greedy(stop_token_ids=(9,))])
    logits = torch.zeros(2, VOCAB)
    logits[:, [EOS, 9, 11]] = torch.tensor([5.0, 6.0, 7.0])
    logits[:, 10] = 1.0
    scores = sampler.process(logits)
    assert scores[0, [EOS, 9, 11]].tolist() == [-math.inf, -math.inf, -math.inf]
    assert scores[1, [EOS, 9, 11]].tolist() == [5.0, 6.0, 7.0]  # no minimum: nothing suppressed
    assert [sampler.sample(logits).token_ids for _ in range(3)] == [[10, 11], [10, 11], [11, 11]]


def test_greedy_ahead_suppresses_stop_token_ids_at_each_position_of_a_row() -> None:
    sampler = make_sampler([greedy(), greedy(min_new_tokens=2, stop_token_ids=(9,))])
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 5.0
    logits[:, 10] = 1.0
    # batch row 1 at 0, 1 and 2 tokens ahead: its stop id is held until two tokens are generated
    assert sampler.greedy_ahead(logits, [1, 1, 1], [0, 1, 2]) == [10, 10, 9]
    assert sampler.greedy_ahead(logits[:1], [0], [0]) == [9]


def test_min_new_tokens_eos_logit_is_minus_infinity_and_logprob_reflects_it() -> None:
    sampler = make_sampler([greedy(min_new_tokens=1, want_logprobs=True, top_n=3)])
    step = sampler.sample(eos_favoured_logits())
    detail = step.details[0]
    assert detail is not None
    assert EOS not in [t.token_id for t in detail.top_tokens]
    assert sampler.process(eos_favoured_logits())[0, EOS] == 5.0  # released after one token


def test_length_penalty_raises_negative_eos_logit_after_start_index() -> None:
    penalty = LengthPenalty(start_index=1, decay_factor=2.0)
    sampler = make_sampler([greedy(length_penalty=penalty), greedy()])
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = -2.0
    seen = []
    for _ in range(4):
        seen.append(sampler.process(logits)[:, EOS].tolist())
        sampler.sample(logits)
    # generated = 0, 1 -> past <= 0; generated 2 -> -2 + 2 * (2 - 1); generated 3 -> -2 + 2 * (4 - 1)
    assert seen == [[-2.0, -2.0], [-2.0, -2.0], [0.0, -2.0], [4.0, -2.0]]


def test_length_penalty_waits_for_min_new_tokens_without_nan() -> None:
    penalty = LengthPenalty(start_index=0, decay_factor=1.5)
    sampler = make_sampler([greedy(length_penalty=penalty, min_new_tokens=2)])
    logits = torch.full((1, VOCAB), 1.0)
    eos = []
    for _ in range(3):
        eos.append(sampler.process(logits)[0, EOS].item())
        sampler.sample(logits)
    assert eos[:2] == [-math.inf, -math.inf]
    assert eos[2] == pytest.approx(1.0 + 1.0 * (1.5**2 - 1))


def test_length_penalty_overflow_stays_finite() -> None:
    sampler = make_sampler([sampling(length_penalty=LengthPenalty(0, 10.0), want_logprobs=True)])
    logits = random_logits(1)
    for _ in range(60):
        step = sampler.sample(logits)
    assert step.token_ids == [EOS]
    assert step.details[0] is not None and step.details[0].logprob == 0.0


# --- repetition context bookkeeping -------------------------------------------------------------------


def expected_penalised(row: torch.Tensor, context: Sequence[int], penalty: float) -> torch.Tensor:
    return hf_expected(row, context, RepetitionPenaltyLogitsProcessor(penalty))


def test_repetition_context_is_per_row_and_follows_prune_and_append() -> None:
    rows = {"a": ([1, 2], 1.5), "b": ([3, 4], 2.0), "c": ([5], 1.0)}
    sampler = make_sampler(
        [greedy(repetition_penalty=p) for _, p in rows.values()], [c for c, _ in rows.values()]
    )
    contexts = {name: list(ctx) for name, (ctx, _) in rows.items()}
    order = ["a", "b", "c"]

    def step(seed: int) -> None:
        logits = random_logits(len(order), seed=seed)
        processed = sampler.process(logits)
        for i, name in enumerate(order):
            assert torch.equal(processed[i], expected_penalised(logits[i], contexts[name], rows[name][1]))
        for name, token in zip(order, sampler.sample(logits).token_ids, strict=True):
            contexts[name].append(token)

    step(1)
    sampler.keep_rows([2, 0])  # drop b, reorder
    order = ["c", "a"]
    step(2)
    rows["d"] = ([9, 9, 8], 1.7)
    contexts["d"] = [9, 9, 8]
    sampler.add_rows([greedy(repetition_penalty=1.7)], [[9, 9, 8]])
    order = ["c", "a", "d"]
    step(3)
    step(4)


def test_repetition_mask_dropped_when_no_row_needs_it_then_rebuilt() -> None:
    sampler = make_sampler([greedy(repetition_penalty=2.0), greedy()], [[1], [2]])
    sampler.keep_rows([1])
    sampler.add_rows([greedy(repetition_penalty=2.0)], [[7]])
    logits = random_logits(2)
    processed = sampler.process(logits)
    assert torch.equal(processed[0], logits[0])
    assert torch.equal(processed[1], expected_penalised(logits[1], [7], 2.0))


def test_context_ids_outside_vocab_are_ignored() -> None:
    sampler = make_sampler([greedy(repetition_penalty=2.0)], [[1, VOCAB, VOCAB + 5]])
    logits = random_logits(1)
    assert torch.equal(sampler.process(logits)[0], expected_penalised(logits[0], [1], 2.0))


# --- choice -------------------------------------------------------------------------------------------


def test_greedy_tie_picks_lowest_id() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [40, 7, 22]] = 3.0
    assert make_sampler([greedy()]).sample(logits).token_ids == [7]


def test_plain_greedy_rows_skip_the_pipeline_with_the_same_tokens_and_state() -> None:
    """Plain greedy rows take their argmax straight from the logits (bfloat16 here, as a model gives
    them); naming the active rows runs the whole pipeline instead: same tokens, same counts, same
    latest tokens, step after step, ties included."""
    plain, piped = make_sampler([greedy(), greedy()]), make_sampler([greedy(), greedy()])
    for step in range(4):
        logits = random_logits(2, seed=step).to(torch.bfloat16)
        logits[1, [5, 9]] = logits[1].max() + 1  # a tie: the lower id wins
        expected = logits.float().argmax(dim=-1).tolist()
        assert expected[1] == 5
        assert plain.sample(logits).token_ids == expected
        assert piped.sample(logits, [0, 1]).token_ids == expected
    assert plain._generated == piped._generated == [4, 4]
    assert torch.equal(plain._last, piped._last)


def test_a_row_short_of_its_minimum_never_takes_eos_or_its_stop_ids() -> None:
    """Rows under min_new_tokens beside a plain one: the argmax stands where it is allowed, and where a
    short row's is an EOS or stop id the pipeline chooses its next best instead, for that row alone."""
    short = [greedy(min_new_tokens=2, stop_token_ids=(9,)), greedy(min_new_tokens=1)]
    sampler = make_sampler([greedy(), *short])
    logits = torch.zeros(3, VOCAB)
    logits[:, 20] = 1.0
    logits[:, 9] = 2.0
    assert sampler.sample(logits).token_ids == [9, 20, 9]  # 9 is row 1's stop id only
    logits[:, EOS] = 3.0
    assert sampler.sample(logits).token_ids == [EOS, 20, EOS]  # row 1 has one token to go
    assert sampler.sample(logits).token_ids == [EOS, EOS, EOS]
    assert sampler._generated == [3, 3, 3]


def run_row(target: SamplingConfig, others_before: int, others_after: int, steps: int = 8) -> list[int]:
    """Sample `target` next to other sampling rows; its logits per step never depend on the others."""
    others = [sampling(seed=100 + i, temperature=0.9) for i in range(others_before + others_after)]
    configs = [*others[:others_before], target, *others[others_before:]]
    sampler = make_sampler(configs)
    tokens = []
    for s in range(steps):
        logits = random_logits(len(configs), seed=1000 + s)
        logits[others_before] = random_logits(1, seed=s)[0]
        tokens.append(sampler.sample(logits).token_ids[others_before])
    return tokens


def test_seeded_sampling_is_reproducible_across_batch_compositions() -> None:
    target = sampling(seed=42, temperature=1.3, top_p=0.95)
    alone = run_row(target, 0, 0)
    assert run_row(target, 2, 0) == alone
    assert run_row(target, 0, 3) == alone
    assert run_row(target, 1, 1) == alone


def test_different_seeds_give_different_tokens() -> None:
    runs = {tuple(run_row(sampling(seed=seed, temperature=2.0), 0, 0, steps=12)) for seed in range(4)}
    assert len(runs) == 4


def test_large_uint64_seed_is_accepted() -> None:
    assert len(run_row(sampling(seed=2**64 - 1), 0, 0, steps=2)) == 2


def test_sampling_frequencies_follow_softmax() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(3000, 4).clone()
    sampler = BatchSampler(4, [], CPU)
    sampler.add_rows([sampling(seed=s) for s in range(3000)], [[]] * 3000)
    counts = torch.bincount(torch.tensor(sampler.sample(logits).token_ids), minlength=4)
    assert counts[3] == 0
    assert torch.allclose(counts.float() / 3000, probs, atol=0.04)


def test_kept_rows_keep_their_generators() -> None:
    a, b = sampling(seed=1), sampling(seed=2)
    alone = make_sampler([b])
    together = make_sampler([a, b])
    first = random_logits(1, seed=9)
    alone.sample(first)
    together.sample(torch.cat([random_logits(1, seed=8), first]))
    together.keep_rows([1])
    later = [random_logits(1, seed=20 + s) for s in range(5)]
    assert [alone.sample(x).token_ids for x in later] == [together.sample(x).token_ids for x in later]


# --- token details ------------------------------------------------------------------------------------


def test_top_k_one_sampling_has_logprob_zero_and_rank_one() -> None:
    sampler = make_sampler([sampling(seed=5, top_k=1, want_logprobs=True, want_ranks=True, top_n=2)])
    logits = random_logits(1)
    step = sampler.sample(logits)
    detail = step.details[0]
    assert detail is not None
    assert step.token_ids == [int(logits.argmax())]
    assert detail.logprob == 0.0 and detail.rank == 1
    assert detail.top_tokens == (TopToken(step.token_ids[0], 0.0),)  # -inf tokens never returned


def test_details_only_for_rows_that_ask_and_only_requested_fields() -> None:
    configs = [greedy(), greedy(want_ranks=True), greedy(want_logprobs=True), greedy(top_n=1)]
    step = make_sampler(configs).sample(random_logits(4))
    assert step.details[0] is None
    ranks, logprobs, top = step.details[1], step.details[2], step.details[3]
    assert ranks is not None and ranks.rank == 1 and ranks.logprob == 0.0 and ranks.top_tokens == ()
    assert logprobs is not None and logprobs.logprob < 0 and logprobs.rank == 0
    assert top is not None and top.rank == 0 and top.logprob == 0.0 and len(top.top_tokens) == 1


def test_greedy_logprob_is_log_softmax_of_penalised_scores() -> None:
    logits = random_logits(1)
    sampler = make_sampler([greedy(repetition_penalty=3.0, want_logprobs=True)], [[int(logits.argmax())]])
    expected = torch.log_softmax(expected_penalised(logits[0], [int(logits.argmax())], 3.0), -1)
    step = sampler.sample(logits)
    assert step.details[0] is not None
    assert step.details[0].logprob == pytest.approx(expected[step.token_ids[0]].item())


def tie_logits() -> torch.Tensor:
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, [30, 4]] = 2.0  # top, tied
    logits[0, [50, 11, 20]] = 1.0  # second, tied
    logits[0, 12] = 0.5
    return logits


def test_rank_counts_only_strictly_greater_scores() -> None:
    logits = tie_logits()
    config = sampling(seed=0, top_k=5, want_ranks=True)
    ranks = set()
    for seed in range(40):
        step = make_sampler([replace(config, seed=seed)]).sample(logits)
        detail = step.details[0]
        assert detail is not None
        ranks.add((step.token_ids[0], detail.rank))
    assert ranks <= {(4, 1), (30, 1), (50, 3), (11, 3), (20, 3)}
    assert {rank for _, rank in ranks} == {1, 3}


def test_top_n_includes_ties_sorted_by_logprob_then_id() -> None:
    step = make_sampler([greedy(want_logprobs=True, top_n=3)]).sample(tie_logits())
    detail = step.details[0]
    assert detail is not None and step.token_ids == [4]
    assert [t.token_id for t in detail.top_tokens] == [4, 30, 11, 20, 50]
    logprobs = [t.logprob for t in detail.top_tokens]
    assert logprobs == sorted(logprobs, reverse=True) and logprobs[0] == detail.logprob


def test_top_n_without_logprobs_is_in_id_order_with_zero_logprob() -> None:
    detail = make_sampler([greedy(top_n=3)]).sample(tie_logits()).details[0]
    assert detail is not None
    assert detail.top_tokens == tuple(TopToken(i, 0.0) for i in [4, 11, 20, 30, 50])


def test_top_n_caps_ties_at_four_n_lowest_ids_first() -> None:
    detail = make_sampler([greedy(want_logprobs=True, top_n=2)]).sample(torch.zeros(1, VOCAB)).details[0]
    assert detail is not None
    assert [t.token_id for t in detail.top_tokens] == list(range(8))


def test_top_n_is_clamped_to_vocab() -> None:
    detail = make_sampler([greedy(top_n=10)], vocab=4).sample(torch.tensor([[0.0, 1.0, 2.0, 3.0]])).details[0]
    assert detail is not None and [t.token_id for t in detail.top_tokens] == [0, 1, 2, 3]


def test_top_k_below_top_n_returns_only_finite_candidates() -> None:
    sampler = make_sampler([sampling(seed=1, top_k=2, want_logprobs=True, top_n=5)])
    detail = sampler.sample(random_logits(1)).details[0]
    assert detail is not None
    assert len(detail.top_tokens) == 2
    assert all(math.isfinite(t.logprob) for t in detail.top_tokens)


def test_mixed_top_n_rows_in_one_batch() -> None:
    logits = torch.cat([tie_logits(), torch.zeros(1, VOCAB), random_logits(1)])
    step = make_sampler([greedy(top_n=1), greedy(top_n=1, want_logprobs=True), greedy()]).sample(logits)
    first, second = step.details[0], step.details[1]
    assert first is not None and [t.token_id for t in first.top_tokens] == [4, 30]
    assert second is not None and [t.token_id for t in second.top_tokens] == [0, 1, 2, 3]
    assert step.details[2] is None


# --- prompt token details -----------------------------------------------------------------------------


def test_prompt_token_details_first_entry_nan_then_scores_next_token() -> None:
    logits = random_logits(4)
    ids = [5, 9, 1, 30]
    details = prompt_token_details(logits, ids, want_logprobs=True, want_ranks=True, top_n=2)
    assert [d.token_id for d in details] == ids
    assert math.isnan(details[0].logprob) and details[0].rank == 0 and details[0].top_tokens == ()
    logprobs = torch.log_softmax(logits, -1)
    for i in range(1, 4):
        row = logprobs[i - 1]
        assert details[i].logprob == pytest.approx(row[ids[i]].item())
        assert details[i].rank == 1 + int((row > row[ids[i]]).sum())
        assert [t.token_id for t in details[i].top_tokens] == row.topk(2).indices.tolist()


def test_prompt_token_details_single_token_prompt() -> None:
    details = prompt_token_details(random_logits(1), [7], want_logprobs=True, want_ranks=True, top_n=3)
    assert len(details) == 1 and details[0].token_id == 7 and math.isnan(details[0].logprob)


def test_prompt_token_details_without_logprobs_leaves_zero() -> None:
    details = prompt_token_details(random_logits(2), [1, 2], want_logprobs=False, want_ranks=True, top_n=0)
    assert details[0].logprob == 0.0 and details[1].logprob == 0.0 and details[1].rank >= 1


def test_prompt_token_details_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError):
        prompt_token_details(random_logits(3), [1, 2], want_logprobs=True, want_ranks=False, top_n=0)


# --- config and shape checks --------------------------------------------------------------------------


def test_sample_rejects_logits_of_wrong_shape() -> None:
    with pytest.raises(ValueError):
        make_sampler([greedy()]).sample(random_logits(2))


def test_empty_batch_samples_nothing() -> None:
    step = BatchSampler(VOCAB, [EOS], CPU).sample(torch.zeros(0, VOCAB))
    assert step == StepSample(token_ids=[], details=[])


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": 0.0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"repetition_penalty": 0.0},
        {"seed": 2**64},
        {"top_n": -1},
    ],
)
def test_config_rejects_out_of_range_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        sampling(**bad)


def test_config_from_params_greedy_ignores_sampling_and_details_need_generated_tokens() -> None:
    params = GenerationParams(
        sampling=SamplingParams(temperature=0.5, top_k=3, seed=9),
        stopping=StoppingParams(min_new_tokens=4),
        response=ResponseOptions(input_tokens=True, token_logprobs=True, top_n_tokens=2),
        repetition_penalty=1.2,
    )
    config = SamplingConfig.from_params(params, seed=9)
    assert config == SamplingConfig(greedy=True, repetition_penalty=1.2, min_new_tokens=4)


def test_config_from_params_sampling_copies_warpers_and_seed() -> None:
    params = GenerationParams(
        method=DecodingMethod.SAMPLE,
        sampling=SamplingParams(temperature=0.5, top_k=3, top_p=0.8, typical_p=0.4),
        response=ResponseOptions(generated_tokens=True, token_ranks=True, top_n_tokens=2),
    )
    config = SamplingConfig.from_params(params, seed=77)
    assert config == sampling(
        temperature=0.5, top_k=3, top_p=0.8, typical_p=0.4, seed=77, want_ranks=True, top_n=2
    )


def test_extend_appends_a_sampled_group_with_its_state():
    """A group sampled on its own and merged continues exactly as if it had always been in the batch."""
    vocab = 32
    configs = [
        SamplingConfig(greedy=False, seed=7, temperature=0.9, repetition_penalty=1.5),
        SamplingConfig(greedy=True, repetition_penalty=2.0, min_new_tokens=3),
    ]
    contexts = [[1, 2, 3], [4, 5]]
    steps = [torch.randn(2, vocab, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    together = BatchSampler(vocab, [0], torch.device("cpu"))
    together.add_rows(configs, contexts)
    expected = [together.sample(logits).token_ids for logits in steps]

    running = BatchSampler(vocab, [0], torch.device("cpu"))
    running.add_rows(configs[:1], contexts[:1])
    group = BatchSampler(vocab, [0], torch.device("cpu"))
    group.add_rows(configs[1:], contexts[1:])
    first = running.sample(steps[0][:1]).token_ids + group.sample(steps[0][1:]).token_ids
    running.extend(group)
    merged = [first] + [running.sample(logits).token_ids for logits in steps[1:]]
    assert merged == expected
    assert running.num_rows == 2


def test_sampling_only_the_active_rows_leaves_the_others_as_they_were() -> None:
    """Verifying proposed tokens samples a subset of rows at a time: each row's tokens, details,
    penalties and generator then follow exactly the steps it took, as if it ran alone."""
    configs = [
        sampling(seed=11, top_k=8, repetition_penalty=1.3, want_logprobs=True, top_n=2),
        sampling(seed=12, temperature=0.7, frequency_penalty=0.5, min_new_tokens=3),
        greedy(repetition_penalty=2.0, presence_penalty=0.4),
    ]
    contexts = [[5, 6], [7], [8, 9, 10]]
    together = make_sampler(configs, contexts)
    alone = [make_sampler([config], [context]) for config, context in zip(configs, contexts, strict=True)]
    schedule = [[0, 1, 2], [0], [1, 2], [2], [0, 1], [0, 1, 2], [1]]
    for step, active in enumerate(schedule):
        logits = random_logits(3, seed=step)
        sample = together.sample(logits, active)
        for row in active:
            solo = alone[row].sample(logits[row : row + 1])
            assert sample.token_ids[row] == solo.token_ids[0], (step, row)
            assert sample.details[row] == solo.details[0], (step, row)
        assert all(sample.details[row] is None for row in range(3) if row not in active)


def test_greedy_rows_choose_every_position_ahead_as_one_at_a_time_would() -> None:
    """Draft verification's one-call path: with min_new_tokens ending inside the look-ahead, the
    choices and the state after keeping runs of different lengths are those of sampling position by
    position with only the still-accepting rows active."""
    configs = [greedy(min_new_tokens=2), greedy(), greedy(min_new_tokens=4)]
    one_by_one, ahead = make_sampler(configs), make_sampler(configs)
    assert ahead.chooses_ahead
    positions = [eos_favoured_logits(3) + random_logits(3, seed=p) / 10 for p in range(4)]
    kept = [2, 1, 4]  # tokens each row keeps
    chosen_by_position = []
    for position, logits in enumerate(positions):
        active = [row for row, count in enumerate(kept) if position < count]
        chosen_by_position.append(one_by_one.sample(logits, active).token_ids)
    stacked = torch.stack([positions[p][row] for row in range(3) for p in range(4)])
    chosen = ahead.greedy_ahead(stacked, [row for row in range(3) for _ in range(4)], [0, 1, 2, 3] * 3)
    assert chosen == [chosen_by_position[p][row] for row in range(3) for p in range(4)]
    assert EOS not in chosen[:2] and EOS in chosen[2:4]  # min_new_tokens=2 lifts after two tokens
    ahead.advance_rows([chosen[4 * row : 4 * row + count] for row, count in enumerate(kept)])
    for step in range(4):  # from here on both choose the same, EOS suppression included
        logits = eos_favoured_logits(3)
        assert ahead.sample(logits).token_ids == one_by_one.sample(logits).token_ids, step


@pytest.mark.parametrize(
    "config",
    [
        greedy(repetition_penalty=1.2),
        greedy(want_logprobs=True),
        greedy(presence_penalty=0.5),
        sampling(seed=3),
    ],
)
def test_rows_whose_scores_depend_on_earlier_tokens_are_not_chosen_ahead(config) -> None:
    sampler = make_sampler([greedy(), config])
    assert not sampler.chooses_ahead
    with pytest.raises(ValueError, match="position by position"):
        sampler.greedy_ahead(random_logits(2), [0, 1], [0, 0])


# --- seeded draws in one call --------------------------------------------------------------------------


def test_a_seeds_uniforms_depend_only_on_the_seed_and_the_draw_count() -> None:
    from tgis.sampling import draws

    first = [draws.uniform(42, n) for n in range(100)]
    assert first == [draws.uniform(42, n) for n in range(100)]
    assert all(0.0 <= u < 1.0 for u in first) and len(set(first)) == 100
    assert draws.uniform(43, 0) != first[0] and draws.uniform(2**64 - 1, 0) != draws.uniform(0, 0)
    assert abs(sum(draws.uniform(7, n) for n in range(20000)) / 20000 - 0.5) < 0.01


def test_a_draw_never_picks_a_token_of_probability_zero() -> None:
    from tgis.sampling import draws

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4, 5)
    chosen = draws.categorical(probs, [0.0, 0.4999, 0.5, 1.0 - 2**-53]).tolist()
    assert chosen == [1, 1, 3, 3]


def test_every_sampling_row_draws_in_one_call(monkeypatch) -> None:
    from tgis.sampling import draws

    calls: list[int] = []
    categorical = draws.categorical

    def counted(probs, uniforms):
        calls.append(len(uniforms))
        return categorical(probs, uniforms)

    monkeypatch.setattr(draws, "categorical", counted)
    sampler = make_sampler([sampling(seed=s, temperature=0.8) for s in range(64)] + [greedy()])
    sampler.sample(random_logits(65))
    assert calls == [64]
