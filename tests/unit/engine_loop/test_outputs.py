"""The output processor fed fabricated step results: events, stops and failures, by request id."""

from __future__ import annotations

import pytest

from tests.unit.engine_loop.fakes import Recorder, spec
from tgis.engine_loop import outputs as outputs_module
from tgis.engine_loop.loop_metrics import LoopMetrics
from tgis.engine_loop.outputs import OutputProcessor
from tgis.engine_loop.results import InputDetails, RowFailure, SampledToken, StepResult
from tgis.metrics import Metrics
from tgis.tokenization.tokenizer import Tokenizer
from tgis.types import FailureEvent, GenerationParams, InputTokensEvent, StoppingParams, TokenEvent


@pytest.fixture
def outputs(tokenizer) -> OutputProcessor:
    metrics = LoopMetrics(Metrics(max_sequence_length=256, max_new_tokens=64, max_batch_size=8))
    return OutputProcessor(Tokenizer(tokenizer), spec(), metrics)


def started(outputs: OutputProcessor, *requests: Recorder) -> None:
    for request in requests:
        request.task.admitted_at = 0.0
        outputs.start(request.task)


def tokens(*ids: int) -> tuple[SampledToken, ...]:
    return tuple(SampledToken(i) for i in ids)


def test_several_tokens_in_one_step_stop_at_the_limit_and_the_rest_are_dropped(outputs) -> None:
    request = Recorder(range(10, 14), 3)
    started(outputs, request)
    done = outputs.update(StepResult(tokens={request.id: tokens(101, 102, 103, 104, 105)}))
    outputs.emit()
    assert done.finished == [request.id]
    assert request.generated == 3 and request.stop_reason == "MAX_TOKENS"
    assert request.id not in outputs


def test_a_stop_sequence_inside_an_accepted_run_ends_the_output_there(outputs, tokenizer) -> None:
    ids = tokenizer("hello world again and again")["input_ids"]
    stop = tokenizer.decode(ids[:2])
    params = GenerationParams(stopping=StoppingParams(max_new_tokens=10, stop_sequences=(stop,)))
    request = Recorder(range(10, 14), 10, params=params)
    started(outputs, request)
    outputs.update(StepResult(tokens={request.id: tokens(*ids)}))
    outputs.emit()
    assert request.stop_reason == "STOP_SEQUENCE"
    assert request.generated == 2
    assert "".join(e.text for e in request.events if isinstance(e, TokenEvent)) == stop


def test_a_failed_row_fails_alone_with_its_token_count(outputs) -> None:
    good, bad = Recorder(range(10, 14), 5), Recorder(range(20, 24), 5)
    started(outputs, good, bad)
    outputs.update(StepResult(tokens={good.id: tokens(101), bad.id: tokens(101)}))
    done = outputs.update(StepResult(tokens={good.id: tokens(102)}, failed={bad.id: RowFailure("boom")}))
    outputs.emit()
    assert done.finished == [bad.id]
    assert bad.failure == "Request failed during generation: Error after generating 1 tokens: boom"
    assert good.failure is None and good.id in outputs


def test_a_detokenizer_that_fails_fails_its_request_alone(outputs, monkeypatch) -> None:
    good, bad = Recorder(range(10, 14), 2), Recorder(range(20, 24), 2)
    started(outputs, good)
    real = outputs_module.for_tokenizer

    def broken(tokenizer, ids, **kwargs):
        detokenizer = real(tokenizer, ids, **kwargs)
        detokenizer.add = lambda token_id: (_ for _ in ()).throw(UnicodeError("bad bytes"))  # type: ignore[method-assign]
        return detokenizer

    monkeypatch.setattr(outputs_module, "for_tokenizer", broken)
    started(outputs, bad)
    done = outputs.update(StepResult(tokens={good.id: tokens(101, 102), bad.id: tokens(101)}))
    outputs.emit()
    assert set(done.finished) == {good.id, bad.id}
    assert bad.failure == "Request failed during detokenization: Token decoding error: bad bytes"
    assert good.generated == 2 and good.failure is None


def test_a_tracker_that_cannot_be_built_raises_and_tracks_nothing(outputs, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise ValueError("no detokenizer")

    monkeypatch.setattr(outputs_module, "for_tokenizer", broken)
    request = Recorder(range(10, 14), 2)
    with pytest.raises(ValueError, match="no detokenizer"):
        outputs.start(request.task)
    assert request.id not in outputs and len(outputs) == 0


def test_a_grammar_that_completes_ends_its_request_with_eos(outputs) -> None:
    params = GenerationParams(stopping=StoppingParams(max_new_tokens=10, min_new_tokens=5))
    request = Recorder(range(10, 14), 10, params=params)
    started(outputs, request)
    outputs.update(StepResult(tokens={request.id: tokens(101, 102)}, guide_finished=frozenset({request.id})))
    outputs.emit()
    assert request.stop_reason == "EOS_TOKEN" and request.generated == 2


def test_tokens_for_an_id_no_longer_tracked_are_ignored(outputs) -> None:
    assert outputs.update(StepResult(tokens={10**9: tokens(101)})).finished == []


def test_an_unstreamed_request_gets_every_event_at_once_with_its_last(outputs, tokenizer) -> None:
    ids = tokenizer(" hello world again")["input_ids"][:3]
    assert len(ids) == 3
    streamed, folded = Recorder(range(10, 14), 3), Recorder(range(10, 14), 3, streamed=False)
    started(outputs, streamed, folded)
    both = (streamed.id, folded.id)
    details = InputDetails(token_ids=(10, 11, 12, 13), details=None)
    outputs.update(
        StepResult(tokens=dict.fromkeys(both, tokens(ids[0])), input_details=dict.fromkeys(both, details))
    )
    outputs.emit()
    assert [type(e) for e in streamed.events] == [InputTokensEvent, TokenEvent]
    assert folded.events == []
    outputs.update(StepResult(tokens=dict.fromkeys(both, tokens(ids[1]))))
    outputs.emit()
    assert len(streamed.events) == 3 and folded.events == []
    done = outputs.update(StepResult(tokens=dict.fromkeys(both, tokens(ids[2]))))
    outputs.emit()
    assert sorted(done.finished) == sorted(both)
    assert len(streamed.events) == 4
    assert folded.events == streamed.events  # the same events, in the same order
    assert folded.stop_reason == "MAX_TOKENS" and folded.generated == 3


def test_an_unstreamed_request_that_fails_gets_the_failure_alone(outputs) -> None:
    folded = Recorder(range(10, 14), 5, streamed=False)
    started(outputs, folded)
    outputs.update(StepResult(tokens={folded.id: tokens(101, 102)}))
    outputs.emit()
    outputs.update(StepResult(failed={folded.id: RowFailure("boom")}))
    outputs.emit()
    assert [type(e) for e in folded.events] == [FailureEvent]
    assert folded.failure == "Request failed during generation: Error after generating 2 tokens: boom"
