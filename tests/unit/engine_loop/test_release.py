"""Every way a request ends leaves nothing behind: the loop over the real paged runner (a counting engine,
prompt-lookup speculation on) tracks a running request in its intake, its output processor and, inside the
runner, the admitted map, the planner (KV blocks), the sampler rows and speculation. Each part owns its
own map; the core's one release per finished id (`runner.release`, and the output processor forgetting
what it emitted last) must empty them all."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from tests.unit.engine_loop.fakes import WAIT_SECONDS, CountingEngine, Recorder
from tgis.batching.admission import Admission
from tgis.batching.blocks import BlockPool
from tgis.batching.paged import BlockWeights, PagedPlanner
from tgis.engine_loop.core import EngineLoop
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.outputs import OutputProcessor
from tgis.engine_loop.paged_runner import PagedRunner
from tgis.engine_loop.speculation import NgramProposer, Speculation
from tgis.metrics import Metrics
from tgis.speculation.gate import BatchGate
from tgis.tokenization.tokenizer import Tokenizer

BLOCK = 4
BLOCKS = 64


class PacedEngine(CountingEngine):
    """The counting engine, one step at a time when `paced` (each waits for a permit)."""

    def __init__(self) -> None:
        super().__init__()
        self.paced = threading.Semaphore(10_000)
        self.stepping = threading.Event()

    def step(self, batch):
        self.stepping.set()
        assert self.paced.acquire(timeout=WAIT_SECONDS)
        return super().step(batch)


@pytest.fixture
def loop_and_engine(tokenizer) -> Iterator[tuple[EngineLoop, PacedEngine]]:
    engine = PacedEngine()
    metrics = LoopMetrics(Metrics(max_sequence_length=256, max_new_tokens=64, max_batch_size=2))
    admission = Admission(max_batch_size=2, max_waiting_tokens=4, weights=BlockWeights(BLOCK, BLOCKS))
    speculation = Speculation(NgramProposer(), max_tokens=3, batch_gate=BatchGate(8), cost_gate=None)
    runner = PagedRunner(
        engine, admission, PagedPlanner(BlockPool(BLOCKS, BLOCK), 16), (), metrics, speculation=speculation
    )
    loop = EngineLoop(runner, OutputProcessor(Tokenizer(tokenizer), engine.spec, metrics), metrics)
    loop.start()
    yield loop, engine
    loop.stop()


def assert_nothing_held(loop: EngineLoop) -> None:
    runner = loop.runner
    assert isinstance(runner, PagedRunner)
    wait_for(lambda: not loop.outputs.tasks() and not loop.intake.waiting())
    assert runner.tracked() == {
        "admitted": 0,
        "planner": 0,
        "sampler_rows": 0,
        "speculation": 0,
        "beam_searches": 0,
    }
    assert runner.planner.pool.usage().used == 0  # every KV block free (cached prefixes may stay)


def wait_for(predicate: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(int(WAIT_SECONDS * 100)):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError("the loop never got there")


def test_finished_requests_leave_nothing(loop_and_engine) -> None:
    loop, _ = loop_and_engine
    requests = [Recorder([1, 2, 3, 1, 2, 3, 1, 2], new_tokens=n) for n in (3, 9, 5)]
    loop.submit([r.task for r in requests])
    for request in requests:
        request.wait()
    assert [r.generated for r in requests] == [3, 9, 5]
    assert_nothing_held(loop)


def test_requests_cancelled_running_and_queued_leave_nothing(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    engine.paced = threading.Semaphore(0)
    running = [Recorder(range(10, 20), new_tokens=40) for _ in range(2)]
    queued = Recorder(range(30, 40), new_tokens=40)  # MAX_BATCH_SIZE=2: it waits
    loop.submit([*(r.task for r in running), queued.task])
    assert engine.stepping.wait(WAIT_SECONDS)
    for request in (*running, queued):
        request.task.cancelled = True
    engine.paced.release(10_000)
    assert_nothing_held(loop)


def test_a_failed_step_and_a_refused_admission_leave_nothing(loop_and_engine) -> None:
    loop, engine = loop_and_engine
    engine.fail_next = RuntimeError("the forward pass failed")
    failing = Recorder(range(10, 20), new_tokens=4)
    loop.submit([failing.task])
    failing.wait()
    assert failing.failure is not None
    refused = Recorder(range(20, 30), new_tokens=4, guide=object())  # no grammar: the sampler refuses it
    after = Recorder(range(40, 44), new_tokens=4)
    loop.submit([refused.task, after.task])
    refused.wait()
    after.wait()
    assert refused.failure is not None and after.generated == 4
    assert_nothing_held(loop)
