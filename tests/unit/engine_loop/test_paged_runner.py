"""The paged runner with a counting engine, driven step by step: what it schedules, samples and frees.

The engine computes nothing: every sequence's next token is its last token + 1. `Drive` does what the
loop core does around the runner (admit, step, release a task once it has all its tokens), with no
thread, so each test reads the runner's decisions step by step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch

from tests.unit.engine_loop.fakes import CountingEngine, Recorder
from tests.unit.work_counter import Work, count_work
from tgis.batching.admission import Admission
from tgis.batching.blocks import BlockPool
from tgis.batching.paged import BlockWeights, PagedPlanner
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.paged_runner import PagedRunner
from tgis.engine_loop.results import StepResult
from tgis.engine_loop.speculation import Speculation
from tgis.metrics import Metrics
from tgis.sampling import BatchSampler
from tgis.speculation.gate import BatchGate, CostGate

BLOCK = 4


def make_runner(
    num_blocks: int = 64, max_step_tokens: int = 8, budget=None
) -> tuple[PagedRunner, CountingEngine]:
    engine = CountingEngine()
    admission = Admission(max_batch_size=8, max_waiting_tokens=4, weights=BlockWeights(BLOCK, num_blocks))
    metrics = LoopMetrics(Metrics(max_sequence_length=256, max_new_tokens=64, max_batch_size=8))
    planner = PagedPlanner(BlockPool(num_blocks, BLOCK), max_step_tokens)
    return PagedRunner(engine, admission, planner, (), metrics, budget), engine


@dataclass
class Drive:
    """The loop core's part, without a thread: admit what `select` allows, step, release the done."""

    runner: PagedRunner
    waiting: list[Recorder] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    limits: dict[int, int] = field(default_factory=dict)

    def submit(self, *requests: Recorder) -> None:
        self.waiting += requests
        self.limits.update((r.id, r.task.input.max_new_tokens) for r in requests)

    def step(self) -> StepResult:
        chosen = self.runner.select([r.task for r in self.waiting]).indices
        for index in chosen:
            self.runner.add(self.waiting[index].task)
        self.waiting = [r for i, r in enumerate(self.waiting) if i not in chosen]
        plan = self.runner.schedule()
        assert plan is not None
        result = self.runner.execute(plan)
        for task_id, sampled in result.tokens.items():
            self.tokens.setdefault(task_id, []).extend(token.token_id for token in sampled)
        done = [i for i, got in self.tokens.items() if len(got) >= self.limits[i]] + list(result.failed)
        self.runner.release(done)
        return result

    def run(self, *requests: Recorder, limit: int = 200) -> None:
        self.submit(*requests)
        for _ in range(limit):
            if not self.runner.busy and not self.waiting:
                return
            self.step()
        raise AssertionError("the requests never finished")


def test_a_long_prompt_is_chunked_under_the_step_budget_while_the_running_stream_decodes() -> None:
    runner, engine = make_runner(max_step_tokens=8)
    drive = Drive(runner)
    running = Recorder(range(100, 104), new_tokens=12)
    drive.submit(running)
    drive.step()
    drive.step()
    long = Recorder(range(200, 230), new_tokens=3)  # 30 prompt tokens: at least 4 steps of 7
    drive.run(long)
    assert all(step.num_tokens <= 8 for step in engine.steps)
    prompt_steps = [s for s in engine.steps if any(c.token_ids[0] >= 200 and c.start < 30 for c in s.prefill)]
    assert len(prompt_steps) >= 4
    assert all(len(step.decode) == 1 for step in prompt_steps)  # the running stream got a token every step
    assert drive.tokens[running.id] == list(range(104, 116))
    assert drive.tokens[long.id] == [230, 231, 232]
    assert runner.usage().blocks_used == 0


class FixedPromptCap:
    """Stands in for PromptBudget: a fixed cap while anything decodes; records what it is told."""

    def __init__(self, cap: int) -> None:
        self.fixed = cap
        self.observed: list[int] = []

    def cap(self, decoding: int, prefilling: int) -> int | None:
        return self.fixed if decoding else None

    def observe(self, tokens: int, seconds: float, decoding: int = 0) -> None:
        assert seconds >= 0 and decoding <= tokens
        self.observed.append(tokens)


def test_the_prompt_budget_caps_prompt_chunks_while_streams_decode_and_learns_from_every_step() -> None:
    budget = FixedPromptCap(5)
    runner, engine = make_runner(max_step_tokens=64, budget=budget)
    drive = Drive(runner)
    running = Recorder(range(100, 104), new_tokens=12)
    drive.submit(running)
    drive.step()
    drive.run(Recorder(range(200, 230), new_tokens=3))  # 30 prompt tokens
    assert sum(len(c.token_ids) for c in engine.steps[0].prefill) == 4  # nothing decoding yet: no cap
    capped = [step for step in engine.steps if step.decode and step.prefill]
    assert len(capped) >= 6  # 30 prompt tokens, 5 at a time beside the decoding stream
    assert all(sum(len(c.token_ids) for c in step.prefill) <= 5 for step in capped)
    assert budget.observed == [step.num_tokens for step in engine.steps]


def test_admission_counts_blocks_at_every_point_in_time_and_never_runs_the_pool_dry() -> None:
    # 9 blocks; a request holds up to 5 (10 prompt + 10 new positions). Two fit side by side when
    # one is far enough along (the granular check: it finishes before the other peaks); three never do.
    runner, engine = make_runner(num_blocks=9, max_step_tokens=64)
    requests = [Recorder(range(start, start + 10), 10) for start in (100, 300, 500)]
    Drive(runner).run(*requests)
    running_together = [len({c.token_ids[0] // 100 for c in step.chunks}) for step in engine.steps]
    assert max(running_together) == 2
    assert runner.usage().blocks_used == 0


def test_a_repeated_prompt_takes_its_cached_blocks_and_computes_only_the_rest() -> None:
    runner, engine = make_runner()
    drive = Drive(runner)
    prompt = range(100, 113)  # 13 tokens: 3 full blocks may be cached, the last position is computed
    first = Recorder(prompt, 2)
    drive.run(first)
    steps_before = len(engine.steps)
    second = Recorder(prompt, 2)
    drive.run(second)
    second_prefill = [c for s in engine.steps[steps_before:] for c in s.prefill]
    assert second_prefill[0].start == 12 and second_prefill[0].token_ids == (112,)
    assert runner.metrics.metrics.prefix_cache_hits._value.get() == 12
    assert drive.tokens[second.id] == drive.tokens[first.id] == [113, 114]


def test_a_request_released_while_its_prompt_is_computed_frees_its_blocks() -> None:
    runner, _ = make_runner(max_step_tokens=16)
    drive = Drive(runner)
    keep, cancel = Recorder(range(100, 105), 6), Recorder(range(300, 340), 30)
    drive.submit(keep, cancel)
    drive.step()  # keep's prompt and part of cancel's
    runner.release([cancel.id])  # what the core does for a cancelled request
    drive.run()
    assert drive.tokens[keep.id] == list(range(105, 111))
    assert cancel.id not in drive.tokens
    assert runner.usage().blocks_used == 0 and runner.usage().admitted == 0


def test_a_failed_step_with_prompt_chunks_fails_only_the_prompts_and_the_decodes_go_on() -> None:
    runner, engine = make_runner(max_step_tokens=64)
    drive = Drive(runner)
    decoding, joining = Recorder(range(100, 104), 6), Recorder(range(200, 210), 4)
    drive.submit(decoding)
    drive.step()
    drive.submit(joining)
    engine.fail_next = RuntimeError("bad prompt")
    result = drive.step()
    assert result.engine_error == "error" and set(result.failed) == {joining.id}
    assert result.failed[joining.id].detail == "bad prompt"
    drive.run()
    assert drive.tokens[decoding.id] == list(range(104, 110))  # its failed step's token computed again
    assert runner.usage().blocks_used == 0


def test_a_failed_step_of_decodes_with_drafts_fails_every_admitted_request() -> None:
    # Draft chunks ride in the engine's prefill list, but no prompt is to blame: nobody may be left to
    # retry the same failing step forever.
    runner, engine = speculating_runner(CountingProposer(), max_step_tokens=64)
    drive = Drive(runner)
    requests = Recorder(range(100, 104), 12), Recorder(range(200, 204), 12)
    drive.submit(*requests)
    drive.step()
    engine.fail_next = RuntimeError("bad kernel")
    step = runner.schedule()
    assert step is not None and set(step.drafts) == {r.id for r in requests} and not step.prompt_tokens
    result = runner.execute(step)
    assert result.engine_error == "error" and set(result.failed) == {r.id for r in requests}
    assert all(f.per_request for f in result.failed.values())


def test_out_of_memory_fails_every_admitted_request() -> None:
    runner, engine = make_runner()
    drive = Drive(runner)
    requests = Recorder(range(100, 104), 6), Recorder(range(200, 204), 6)
    drive.submit(*requests)
    drive.step()
    engine.fail_next = RuntimeError("CUDA out of memory")
    result = drive.step()
    assert result.engine_error == "oom" and set(result.failed) == {r.id for r in requests}
    assert {f.detail for f in result.failed.values()} == {"GPU out of memory"}
    assert not any(f.per_request for f in result.failed.values())


def test_a_request_whose_sampler_row_cannot_be_built_fails_alone() -> None:
    """A grammar that is not compiled is refused by the sampler when the prompt completes."""
    runner, _ = make_runner()
    drive = Drive(runner)
    good, bad = Recorder(range(100, 104), 3), Recorder(range(200, 204), 3, guide="not a grammar")
    drive.submit(good, bad)
    result = drive.step()
    assert set(result.failed) == {bad.id} and "not a compiled grammar" in result.failed[bad.id].detail
    assert bad.id not in result.tokens
    drive.run()
    assert drive.tokens[good.id] == [104, 105, 106]


def test_a_lone_request_whose_sampler_row_cannot_be_built_fails_alone_and_the_runner_goes_on() -> None:
    """The step's only prompt fails to start sampling: its logits are there but no row is, and the
    step samples nothing instead of indexing an empty selection of rows."""
    runner, _ = make_runner()
    drive = Drive(runner)
    bad = Recorder(range(200, 204), 3, guide="not a grammar")
    drive.submit(bad)
    result = drive.step()
    assert set(result.failed) == {bad.id} and result.tokens == {}
    later = Recorder(range(100, 104), 3)
    drive.run(later)
    assert drive.tokens[later.id] == [104, 105, 106]


def _bookkeeping_work(num_blocks: int) -> Work:
    """40 steps of 16 decoding sequences: each step's schedule, execute and release, and a read of
    the pool's usage."""
    runner, _ = make_runner(num_blocks=num_blocks, max_step_tokens=64)
    drive = Drive(runner)
    drive.submit(*(Recorder(range(10 * i, 10 * i + 8), 60) for i in range(16)))
    drive.step()

    def steps() -> None:
        for _ in range(40):
            drive.step()
            runner.usage()

    return count_work(steps)


def test_a_steps_bookkeeping_does_not_grow_with_the_pool() -> None:
    """A pool a thousand times larger runs the same Python lines and calls, give or take a timed branch:
    no Python loop or call per block (a single C call that walks a list would not show; work_counter)."""
    small = _bookkeeping_work(1_000)
    assert small.lines > 1_000 and small.calls > 1_000, small  # the counters saw the steps
    large = _bookkeeping_work(1_000_000)
    assert large.about(small), (small, large)


class CountingProposer:
    """Drafts the counting engine's own continuation (last + 1, + 2, ...), its `wrong`-th token off."""

    wants_hidden = False

    def __init__(self, wrong: int | None = None) -> None:
        self.wrong = wrong
        self.last: dict[int, int] = {}

    def start(self, task_id: int, prompt) -> None:
        self.last[task_id] = prompt[-1]

    def extend(self, task_id: int, tokens, hidden=None) -> None:
        self.last[task_id] = tokens[-1]

    def stop(self, task_id: int) -> None:
        self.last.pop(task_id, None)

    def propose(self, task_ids, count: int) -> dict[int, tuple[int, ...]]:
        drafts = {}
        for task_id in task_ids:
            draft = [self.last[task_id] + 1 + i for i in range(count)]
            if self.wrong is not None and self.wrong < count:
                draft[self.wrong] += 7
            drafts[task_id] = tuple(draft)
        return drafts


def speculating_runner(
    proposer: CountingProposer, tokens: int = 4, **kwargs
) -> tuple[PagedRunner, CountingEngine]:
    runner, engine = make_runner(**kwargs)
    runner.speculation = Speculation(proposer, tokens, BatchGate(8), cost_gate=None)
    return runner, engine


@pytest.mark.parametrize("wrong", [None, 0, 2])
@pytest.mark.parametrize("ahead", [True, False], ids=["chosen-ahead", "position-by-position"])
def test_drafts_are_verified_in_one_step_and_the_output_is_unchanged(wrong, ahead, monkeypatch) -> None:
    """Greedy rows choose every draft position in one call; rows that cannot (penalties, sampling) go
    position by position: both keep the same runs."""
    monkeypatch.setattr(BatchSampler, "chooses_ahead", property(lambda sampler: ahead))
    runner, engine = speculating_runner(CountingProposer(wrong), max_step_tokens=64)
    drive = Drive(runner)
    requests = [Recorder(range(100, 104), 12), Recorder(range(300, 310), 9)]
    drive.run(*requests)
    assert drive.tokens[requests[0].id] == list(range(104, 116))
    assert drive.tokens[requests[1].id] == list(range(310, 319))
    draft_steps = [step for step in engine.steps if any(len(c.token_ids) > 1 for c in step.prefill)]
    assert draft_steps, "no step verified a draft"
    per_step = {None: 5, 0: 1, 2: 3}[wrong]  # tokens a speculating sequence gains per step
    assert len(engine.steps) <= 1 + -(-12 // per_step) + 1
    assert runner.usage().blocks_used == 0


class StateRecordingProposer(CountingProposer):
    """Reads hidden states, as the MLP speculator does, and records each (new tokens, state) it gets."""

    wants_hidden = True

    def __init__(self, wrong: int | None = None) -> None:
        super().__init__(wrong)
        self.seen: list[tuple[list[int], torch.Tensor | None]] = []

    def extend(self, task_id: int, tokens, hidden=None) -> None:
        super().extend(task_id, tokens)
        self.seen.append((list(tokens), hidden))


def test_a_proposer_gets_the_state_of_the_position_that_produced_the_newest_token() -> None:
    """The counting engine's state of a position is its token, and its token + 1 comes next: so the
    state handed over with each step's tokens is their last one - 1, after a whole, a partly rejected
    and no draft alike."""
    proposer = StateRecordingProposer(wrong=2)
    runner, _ = speculating_runner(proposer, max_step_tokens=64)
    drive = Drive(runner)
    drive.run(Recorder(range(100, 104), 12), Recorder(range(300, 310), 9))
    assert {len(tokens) for tokens, _ in proposer.seen} >= {1, 3}  # a prompt's first token; a draft's run
    for tokens, hidden in proposer.seen:
        assert hidden is not None and hidden.shape == (1,)
        assert int(hidden.item()) == tokens[-1] - 1, (tokens, hidden)


def test_steps_that_verify_drafts_do_not_teach_the_prompt_budget() -> None:
    """A draft position returns its logits to be verified, which a prompt token does not: the budget
    that caps prompt chunks learns what a token costs from the steps without drafts only."""
    budget = FixedPromptCap(64)
    runner, engine = speculating_runner(CountingProposer(), max_step_tokens=64, budget=budget)
    drive = Drive(runner)
    drive.run(Recorder(range(100, 104), 12), Recorder(range(300, 310), 9))
    with_drafts = [
        step for step in engine.steps if any(c.all_logits and len(c.token_ids) > 1 for c in step.prefill)
    ]
    assert with_drafts, "no step verified a draft"
    assert budget.observed == [step.num_tokens for step in engine.steps if step not in with_drafts]


def test_a_draft_never_reaches_past_the_reserved_positions() -> None:
    runner, engine = speculating_runner(CountingProposer(), tokens=8, max_step_tokens=64)
    drive = Drive(runner)
    request = Recorder(range(100, 104), 3)  # 4 prompt + 3 new positions reserved
    drive.run(request)
    assert drive.tokens[request.id] == [104, 105, 106]
    assert max(c.start + len(c.token_ids) for s in engine.steps for c in s.chunks) <= 4 + 3


def test_a_sequence_whose_drafts_break_early_brings_shorter_drafts() -> None:
    """Drafts of 8 whose second token is always wrong: after the first, each sequence proposes only
    one token past what held (2), so no step carries positions that were bound to be thrown away."""
    runner, engine = speculating_runner(CountingProposer(wrong=1), tokens=8, max_step_tokens=64)
    drive = Drive(runner)
    request = Recorder(range(100, 104), 16)
    drive.run(request)
    assert drive.tokens[request.id] == list(range(104, 120))  # the output is what it always is
    drafts = [len(c.token_ids) - 1 for step in engine.steps for c in step.prefill if c.start >= 4]
    assert drafts[0] == 8 and set(drafts[1:]) == {2}, drafts


def test_rejected_draft_positions_give_back_the_blocks_only_they_used() -> None:
    runner, _ = speculating_runner(CountingProposer(wrong=0), tokens=8, num_blocks=16)
    drive = Drive(runner)
    request = Recorder(range(100, 103), 20)
    drive.submit(request)
    drive.step()  # the prompt, and the first token
    drive.step()  # a draft of 8 from position 3 reaches block 2 (positions 8-11); all rejected
    assert drive.tokens[request.id] == [103, 104]
    assert runner.usage().blocks_used == 2  # positions 0-4 need blocks 0 and 1 only


class RecordingCostGate(CostGate):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, bool, int]] = []
        self.seconds: list[float] = []

    def record(self, decoding: int, speculated: bool, seconds: float, tokens: int) -> None:
        assert seconds > 0
        self.records.append((decoding, speculated, tokens))
        self.seconds.append(seconds)
        super().record(decoding, speculated, seconds, tokens)


def recording_gate_runner() -> tuple[Drive, CountingEngine, RecordingCostGate]:
    """A speculating runner whose cost gate records what it is fed."""
    runner, engine = speculating_runner(CountingProposer(), max_step_tokens=64)
    gate = RecordingCostGate()
    assert runner.speculation is not None
    runner.speculation.cost_gate = gate
    return Drive(runner), engine, gate


def test_pure_decode_steps_feed_the_cost_gate_with_their_tokens() -> None:
    drive, engine, gate = recording_gate_runner()
    request = Recorder(range(100, 104), 12)
    drive.run(request)
    assert drive.tokens[request.id] == list(range(104, 116))  # whichever mode each step took
    # Every step but the prompt's: the last one's cost closes when its sequence leaves.
    assert len(gate.records) == len(engine.steps) - 1
    assert gate.records[0] == (1, True, 5)  # measured speculating first: the draft of 4 all accepted
    assert (1, False, 1) in gate.records  # then plain decoding, one token
    assert sum(tokens for _, _, tokens in gate.records) == 12 - 1  # the prompt's step sampled the first


def test_a_decode_step_costs_until_the_next_step_begins() -> None:
    """The tokens' hand-off, stop rules and events after a step are part of what it costs."""
    drive, _, gate = recording_gate_runner()
    drive.submit(Recorder(range(100, 104), 40))
    drive.step()  # the prompt: not a decode step's cost
    drive.step()
    assert gate.records == []  # known only when the next step begins
    time.sleep(0.05)  # what the loop does between two steps
    drive.step()
    assert len(gate.records) == 1 and gate.seconds[0] >= 0.05


class SteppingClock:
    """A monotonic clock that moves a millisecond each time it is read, and as far as a test says."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def test_the_wait_for_the_next_request_is_no_cost_of_the_last_step(monkeypatch) -> None:
    """One client sending one request after another: the loop idles between them, and that wait must not
    count against whichever mode (speculating or plain) the finishing step took."""
    clock = SteppingClock()
    monkeypatch.setattr(time, "monotonic", clock)
    drive, _, gate = recording_gate_runner()
    drive.run(Recorder(range(100, 104), 6))
    recorded = len(gate.records)
    assert recorded > 0
    clock.now += 60.0  # the client's turnaround: nothing runs for a minute
    drive.submit(Recorder(range(200, 204), 6))
    drive.step()  # the next request's prompt
    assert len(gate.records) == recorded
    assert max(gate.seconds) < 60.0


def test_no_draft_rides_in_a_step_that_carries_a_prompt_chunk() -> None:
    runner, engine = speculating_runner(CountingProposer(), tokens=2, max_step_tokens=12)
    drive = Drive(runner)
    running = Recorder(range(100, 104), 30)
    drive.submit(running)
    drive.step()
    drive.step()
    assert any(len(c.token_ids) > 1 for c in engine.steps[-1].prefill), "a lone decode step speculates"
    joining = Recorder(range(500, 530), 4)  # 30 prompt tokens: chunked over several steps
    drive.run(joining)
    assert drive.tokens[running.id] == list(range(104, 134))
    assert drive.tokens[joining.id] == list(range(530, 534))
    for step in engine.steps[2:]:
        prompt_chunk = any(c.token_ids[0] >= 500 and c.start < 30 for c in step.prefill)
        drafted = any(c.token_ids[0] < 500 and len(c.token_ids) > 1 for c in step.prefill)
        assert not (prompt_chunk and drafted)
    assert sum(any(c.token_ids[0] >= 500 for c in s.prefill) for s in engine.steps) >= 3
