"""The loop core with a scripted runner and no model: admission, cancellation, failing rows, probes,
crashes. Steps are paced through the runner's gate, so every wait here is for an event."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from engines.base import EngineFatalError
from tests.unit.engine_loop.fakes import WAIT_SECONDS, Recorder, ScriptedRunner, spec
from tgis.engine_loop.core import EngineLoop
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.outputs import OutputProcessor
from tgis.errors import GenerationError
from tgis.metrics import Metrics
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import GenerationHealth


@pytest.fixture
def make_loop(tokenizer) -> Iterator:
    loops: list[EngineLoop] = []

    def make(runner: ScriptedRunner, **hooks) -> EngineLoop:
        metrics = LoopMetrics(Metrics(max_sequence_length=256, max_new_tokens=64, max_batch_size=8))
        loop = EngineLoop(runner, OutputProcessor(Tokenizer(tokenizer), spec(), metrics), metrics, **hooks)
        loop.start()
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.stop()


def failures(loop: EngineLoop, err: str) -> float:
    return loop.metrics.metrics.request_failure.labels(err=err)._value.get()


def test_requests_beyond_the_runners_capacity_wait_and_run_as_others_finish(make_loop) -> None:
    runner = ScriptedRunner(capacity=2)
    loop = make_loop(runner)
    requests = [Recorder(range(10, 14), new_tokens=n) for n in (3, 5, 2, 4)]
    loop.submit([r.task for r in requests])
    for request in requests:
        request.wait()
    assert [r.generated for r in requests] == [3, 5, 2, 4]
    assert {r.stop_reason for r in requests} == {"MAX_TOKENS"}
    assert sorted(runner.released) == sorted(r.id for r in requests)  # every one freed what it held
    assert loop.admitted_count == 0 and loop.load().waiting == 0


def test_a_request_cancelled_mid_step_is_released_and_gets_no_more_events(make_loop) -> None:
    runner = ScriptedRunner()
    runner.gate = threading.Semaphore(0)
    loop = make_loop(runner)
    keep, cancel = Recorder(range(10, 14), 4), Recorder(range(20, 24), 50)
    loop.submit([keep.task, cancel.task])
    assert runner.executing.wait(WAIT_SECONDS)
    cancel.task.cancelled = True  # while the step runs
    runner.gate.release(100)
    keep.wait()
    assert cancel.id in runner.released and not cancel.done.is_set()
    assert cancel.generated <= 1  # at most the token of the step it was cancelled in
    assert failures(loop, "cancelled") == 1


def test_a_row_the_runner_fails_fails_alone_and_says_how_far_it_got(make_loop) -> None:
    runner = ScriptedRunner()
    loop = make_loop(runner)
    good, bad = Recorder(range(10, 14), 6), Recorder(range(20, 24), 6)
    runner.fail_rows[bad.id] = "row exploded"
    loop.submit([good.task, bad.task])
    good.wait()
    bad.wait()
    assert bad.failure == "Request failed during generation: row exploded"
    assert good.generated == 6 and good.failure is None
    assert bad.id in runner.released


def test_a_task_the_runner_refuses_at_admission_fails_alone(make_loop) -> None:
    runner = ScriptedRunner()
    loop = make_loop(runner)
    good, bad = Recorder(range(10, 14), 3), Recorder(range(20, 24), 3)
    runner.refuse.add(bad.id)
    loop.submit([bad.task, good.task])
    good.wait()
    bad.wait()
    assert bad.failure == f"Request failed during generation: task {bad.id} refused"
    assert good.generated == 3
    assert loop.alive


def test_probes_run_between_steps_and_decide_generation_health(make_loop) -> None:
    runner = ScriptedRunner()
    health: list[GenerationHealth] = []
    loop = make_loop(runner, on_health=health.append)
    assert loop.probe([1, 2, 3]).result(WAIT_SECONDS) == 42
    assert loop.generation_healthy
    runner.probe_error = RuntimeError("device lost")
    with pytest.raises(RuntimeError, match="device lost"):
        loop.probe([1, 2, 3]).result(WAIT_SECONDS)
    assert health == [GenerationHealth.HEALTHY, GenerationHealth.FAILED]


def test_a_fatal_engine_error_crashes_the_loop_and_fails_everyone_waiting(make_loop) -> None:
    runner = ScriptedRunner(capacity=1)
    runner.gate = threading.Semaphore(0)
    crashes: list[BaseException] = []
    loop = make_loop(runner, on_fatal=crashes.append)
    running, queued = Recorder(range(10, 14), 5), Recorder(range(20, 24), 5)
    loop.submit([running.task, queued.task])
    assert runner.executing.wait(WAIT_SECONDS)
    runner.fatal = EngineFatalError("rank 1 died")
    runner.gate.release()
    running.wait()
    queued.wait()
    expected = "Request failed during generation: batching loop crashed"
    assert running.failure == expected and queued.failure == expected
    assert isinstance(crashes[0], EngineFatalError)
    loop.stop(WAIT_SECONDS)
    with pytest.raises(GenerationError, match="the batching loop is not running"):
        loop.submit([Recorder(range(3), 1).task])


def test_stopping_ends_the_thread_and_refuses_new_work(make_loop) -> None:
    runner = ScriptedRunner()
    loop = make_loop(runner)
    request = Recorder(range(10, 14), 2)
    loop.submit([request.task])
    request.wait()
    loop.stop()
    assert not loop.alive
    with pytest.raises(GenerationError):
        loop.submit([Recorder(range(3), 1).task])
