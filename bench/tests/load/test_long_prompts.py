"""The long-prompt mix and the per-client request counts of the benchmark workload."""

from __future__ import annotations

import pytest

from tgis_bench.load.results import workload_info
from tgis_bench.load.workload import (
    FILLER_WORDS,
    WORDS,
    LengthRange,
    WorkloadSpec,
    build_workload,
    fingerprint,
    level_requests,
)

PLAIN = WorkloadSpec(requests=16, prompt_tokens=LengthRange(8, 24), new_tokens=LengthRange(48, 48), seed=4)
MIX = WorkloadSpec(
    16, LengthRange(8, 24), LengthRange(48, 48), seed=4, long_prompt_every=4, long_prompt_words=400
)


def test_every_fourth_request_brings_a_400_word_prompt(tokenizer):
    requests = build_workload(tokenizer, MIX)
    long = [r.index for r in requests if len(r.text.split()) == 400]
    assert long == [3, 7, 11, 15]
    assert [MIX.is_long(index) for index in range(8)] == [False, False, False, True] * 2
    for request in requests:
        if request.index in long:
            assert all(word in WORDS for word in request.text.split())
            assert len(request.input_ids) >= 400  # at least a token per word
        else:
            assert 8 <= len(request.input_ids) <= 24
        assert request.max_new_tokens == 48


def test_the_other_requests_are_those_of_the_plain_workload(tokenizer):
    plain, mix = build_workload(tokenizer, PLAIN), build_workload(tokenizer, MIX)
    assert [r for r in mix if not MIX.is_long(r.index)] == [r for r in plain if not MIX.is_long(r.index)]
    assert fingerprint(mix) != fingerprint(plain)


def test_the_mix_is_deterministic_and_its_long_prompts_differ(tokenizer):
    first, second = build_workload(tokenizer, MIX), build_workload(tokenizer, MIX)
    assert first == second
    long_texts = {r.text for r in first if MIX.is_long(r.index)}
    assert len(long_texts) == 4


def test_the_workload_record_states_the_mix(tokenizer):
    requests = build_workload(tokenizer, MIX)
    info = workload_info(MIX, requests, stream=True, per_client=2)
    lengths = [len(r.input_ids) for r in requests if MIX.is_long(r.index)]
    assert (info.long_prompt_every, info.long_prompt_words) == (4, 400)
    assert info.long_prompt_tokens == f"{min(lengths)}:{max(lengths)}"
    assert info.requests_per_client == 2
    plain = workload_info(PLAIN, build_workload(tokenizer, PLAIN), stream=True)
    assert (plain.long_prompt_every, plain.long_prompt_words, plain.long_prompt_tokens) == (0, 0, "")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shared_prefix_tokens": 16}, "either a shared prefix or long prompts"),
        ({"long_prompt_every": -1}, "positive"),
        ({"long_prompt_words": 0}, "positive"),
    ],
)
def test_impossible_mixes_are_refused(changes, message):
    settings = {"long_prompt_every": 4, "long_prompt_words": 400} | changes
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(4, LengthRange(8, 8), LengthRange(4, 4), **settings)


def test_long_prompts_longer_than_the_filler_text_are_refused(tokenizer):
    spec = WorkloadSpec(
        4, LengthRange(8, 8), LengthRange(4, 4), long_prompt_every=2, long_prompt_words=FILLER_WORDS + 1
    )
    with pytest.raises(ValueError, match="exceed"):
        build_workload(tokenizer, spec)


def test_each_level_sends_its_share_of_the_requests(tokenizer):
    requests = build_workload(tokenizer, PLAIN)
    assert level_requests(requests, 8, None) == requests
    assert level_requests(requests, 3, 2) == requests[:6]
    assert level_requests(requests, 1, 4) == requests[:4]
    assert level_requests(requests, 64, 4) == requests  # never more than the workload holds
