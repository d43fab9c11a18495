"""GrammarCache (constraints from the proto, LRU, timeout, errors) and GuideRows in the BatchSampler."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tgis.errors import ValidationError
from tgis.guided import ANY_JSON_OBJECT_SCHEMA, Constraint, GrammarCache
from tgis.pb import generation_pb2 as pb
from tgis.rpc.params import constraint_of
from tgis.sampling import BatchSampler, SamplingConfig

EOS = 1


@pytest.fixture
def cache(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[EOS], max_entries=2)


def _params(**guided) -> pb.Parameters:
    return pb.Parameters(decoding=pb.DecodingParameters(**guided))


def test_constraint_of_reads_every_kind():
    assert constraint_of(None) is None
    assert constraint_of(pb.Parameters()) is None
    assert constraint_of(_params(format=pb.DecodingParameters.TEXT)) is None
    assert constraint_of(_params(format=pb.DecodingParameters.JSON)) == Constraint(
        "format", ANY_JSON_OBJECT_SCHEMA
    )
    assert constraint_of(_params(regex="a+")) == Constraint("regex", "a+")
    assert constraint_of(_params(json_schema="{}")) == Constraint("json_schema", "{}")
    assert constraint_of(_params(grammar='root ::= "a"')) == Constraint("grammar", 'root ::= "a"')
    choice = constraint_of(_params(choice=pb.DecodingParameters.StringChoices(choices=['a"b', "c\\"])))
    assert choice == Constraint("choice", r'root ::= "a\"b" | "c\\"')


@pytest.mark.parametrize("choices", [[], ["only"]])
def test_fewer_than_two_choices_are_refused(choices):
    with pytest.raises(ValidationError, match=r"^Must provide at least two choices$"):
        constraint_of(_params(choice=pb.DecodingParameters.StringChoices(choices=choices)))


def test_cache_hits_and_evicts_least_recently_used(cache):
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    first = asyncio.run(cache.compile(a))
    assert asyncio.run(cache.compile(a)) is first
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    asyncio.run(cache.compile(b))
    asyncio.run(cache.compile(a))  # a is now the most recent: c evicts b
    asyncio.run(cache.compile(c))
    assert len(cache) == 2
    assert asyncio.run(cache.compile(a)) is first
    misses = cache.misses
    asyncio.run(cache.compile(b))
    assert cache.misses == misses + 1


def test_compile_errors_name_the_field(cache):
    with pytest.raises(ValidationError) as error:
        asyncio.run(cache.compile(Constraint("regex", "(")))
    # xgrammar's "[hh:mm:ss] file.cc:line: " log prefix is stripped.
    expected = (
        "invalid guided decoding regex: Regex parsing error at position 2: The parenthesis is not closed."
    )
    assert error.value.message == expected
    assert len(cache) == 0  # failures are not cached


def test_a_slow_compile_times_out(cache, monkeypatch):
    def slow(constraint):
        time.sleep(0.5)
        raise AssertionError("never reached in time")

    monkeypatch.setattr(cache, "_compile", slow)
    cache.timeout_seconds = 0.05
    with pytest.raises(ValidationError, match=r"^guided decoding json_schema did not compile within 0.05 s$"):
        asyncio.run(cache.compile(Constraint("json_schema", "{}")))


def test_sampler_masks_only_guided_rows(cache, tokenizer):
    vocab = len(tokenizer)
    grammar = asyncio.run(cache.compile(Constraint("regex", "[0-9]")))
    sampler = BatchSampler(vocab, [EOS], torch.device("cpu"))
    sampler.add_rows([SamplingConfig(greedy=True), SamplingConfig(greedy=True, guide=grammar)], [[], []])
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    scores = sampler.process(logits)
    assert torch.equal(scores[0], logits[0])  # unguided: untouched
    allowed = [t for t in range(vocab) if scores[1, t] > float("-inf")]
    assert allowed and all(tokenizer.decode([t]) in "0123456789" for t in allowed)
    step = sampler.sample(logits)
    assert tokenizer.decode([step.token_ids[1]]) in "0123456789"
    assert step.guide_finished == ()
    finish = sampler.sample(logits)  # after one digit the grammar only allows EOS
    assert finish.token_ids[1] == EOS
    assert finish.guide_finished == (1,)
    sampler.keep_rows([0])
    assert torch.equal(sampler.process(logits[:1]), logits[:1])


def test_the_device_path_masks_the_guided_rows_as_xgrammars_kernel_does():
    """What a GPU runs (the guided rows' bitmasks copied over, applied with torch to those rows only)
    sets the same scores to -inf as xgrammar's CPU kernel over the whole batch."""
    import xgrammar as xgr

    from tgis.sampling.guide import apply_bitmask_rows

    vocab, rows = 100, [1, 4, 5]
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(6, vocab, generator=generator)
    full = xgr.allocate_token_bitmask(6, vocab)
    full.copy_(
        torch.randint(-(2**31), 2**31, full.shape, generator=generator, dtype=torch.int64).to(torch.int32)
    )
    expected = scores.clone()
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=vocab, indices=rows)
    got = scores.clone()
    apply_bitmask_rows(got, full[rows], torch.tensor(rows), vocab)
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 2, 3]], scores[[0, 2, 3]])  # unguided rows untouched
    assert bool((got[rows] == float("-inf")).any())


def test_a_sampler_on_the_device_path_guides_as_on_the_cpu(cache, tokenizer):
    vocab = len(tokenizer)
    grammar = asyncio.run(cache.compile(Constraint("regex", "[0-9]+")))
    configs = [SamplingConfig(greedy=True), SamplingConfig(greedy=True, guide=grammar)] * 2
    cpu, device_path = (BatchSampler(vocab, [EOS], torch.device("cpu")) for _ in range(2))
    device_path._guides._on_device = True  # the path a GPU takes, here with CPU tensors
    for sampler in (cpu, device_path):
        sampler.add_rows(configs, [[]] * len(configs))
    for step in range(3):
        logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(step))
        assert torch.equal(device_path.process(logits), cpu.process(logits))
        assert device_path.sample(logits).token_ids == cpu.sample(logits).token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_guided_rows_on_cuda_mask_as_on_the_cpu(cache, tokenizer):
    """On a GPU the guided rows' bitmasks go to the device (pinned, one copy) and are applied there: the
    scores and tokens are the CPU's."""
    vocab = len(tokenizer)
    grammar = asyncio.run(cache.compile(Constraint("regex", "[0-9]+")))
    configs = [SamplingConfig(greedy=True), SamplingConfig(greedy=True, guide=grammar)] * 3
    cpu, gpu = (
        BatchSampler(vocab, [EOS], torch.device("cpu")),
        BatchSampler(vocab, [EOS], torch.device("cuda")),
    )
    for sampler in (cpu, gpu):
        sampler.add_rows(configs, [[]] * len(configs))
    for step in range(3):
        logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(step))
        assert torch.equal(gpu.process(logits.cuda()).cpu(), cpu.process(logits))
        assert gpu.sample(logits.cuda()).token_ids == cpu.sample(logits).token_ids
