"""One log line per request: correlation id, parameters, timings, token counts, stop reason; JSON_OUTPUT."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import grpc
import pytest

from tests.ops.serving import OpsServer
from tgis.logs import REQUEST_LOGGER, configure_logging
from tgis.pb import generation_pb2 as pb

TIMES = ("validation_time", "queue_time", "inference_time", "time_per_token", "total_time")


@pytest.fixture(scope="module")
def server(model_dirs) -> Iterator[OpsServer]:
    with OpsServer(model_dirs("gpt2")) as running:
        yield running


def request_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == REQUEST_LOGGER.name]


def fields_of(record: logging.LogRecord) -> dict:
    fields = getattr(record, "fields", None)
    assert isinstance(fields, dict)
    return fields


def test_a_generate_request_logs_one_line_with_everything(
    server: OpsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER.name)
    params = pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.7, top_k=5, seed=42),
        stopping=pb.StoppingCriteria(max_new_tokens=6, min_new_tokens=6, stop_sequences=["zzz"]),
    )
    server.stub().Generate(
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="hello there")], params=params),
        metadata=[("x-correlation-id", "corr-123")],
        timeout=60,
    )
    (record,) = request_records(caplog)
    fields = fields_of(record)
    assert fields["method"] == "Generate"
    assert fields["correlation_id"] == "corr-123"
    assert fields["input_chars"] == len("hello there")
    assert fields["params"]["method"] == "SAMPLE"
    assert fields["params"]["max_new_tokens"] == 6
    assert fields["params"]["temperature"] == pytest.approx(0.7)
    assert fields["params"]["top_k"] == 5 and fields["params"]["seed"] == 42
    assert fields["params"]["stop_sequences"] == 1
    assert fields["generated_tokens"] == 6
    assert fields["input_tokens"] > 0
    assert fields["stop_reason"] == "MAX_TOKENS"
    for name in TIMES:
        assert fields[name] >= 0, name
    assert fields["inference_time"] <= fields["total_time"]
    assert fields["time_per_token"] == pytest.approx(fields["inference_time"] / 6)
    message = record.getMessage()
    assert "correlation_id=corr-123" in message
    assert "generated 6 tokens before MAX_TOKENS" in message
    for name in TIMES:
        assert f"{name}=" in message and "ms" in message


def test_a_batch_logs_one_line_per_input(server: OpsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER.name)
    server.stub().Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="a"), pb.GenerationRequest(text="bb")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2, min_new_tokens=2)),
        ),
        metadata=[("x-correlation-id", "batch-7")],
        timeout=60,
    )
    lines = [fields_of(record) for record in request_records(caplog)]
    assert [(f["input"], f["input_chars"], f["correlation_id"]) for f in lines] == [
        ("1/2", 1, "batch-7"),
        ("2/2", 2, "batch-7"),
    ]


def test_a_stream_logs_its_line_when_it_ends(server: OpsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER.name)
    request = pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text="stream me"),
        params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=3, min_new_tokens=3)),
    )
    list(server.stub().GenerateStream(request, metadata=[("x-correlation-id", "s-1")], timeout=60))
    (record,) = request_records(caplog)
    fields = fields_of(record)
    assert fields["method"] == "GenerateStream"
    assert fields["correlation_id"] == "s-1"
    assert fields["generated_tokens"] == 3 and fields["stop_reason"] == "MAX_TOKENS"


def test_a_rejected_request_logs_the_error(server: OpsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER.name)
    with pytest.raises(grpc.RpcError):
        server.stub().Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="x")],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1, min_new_tokens=2)),
            ),
            metadata=[("x-correlation-id", "bad-1")],
            timeout=60,
        )
    (record,) = request_records(caplog)
    fields = fields_of(record)
    assert fields["correlation_id"] == "bad-1"
    assert fields["error"] == "min_new_tokens must be <= max_new_tokens"
    assert "failed" in record.getMessage()


def test_without_a_correlation_id_the_line_carries_a_generated_one(
    server: OpsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER.name)
    server.stub().Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="x")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=1)),
        ),
        timeout=60,
    )
    (record,) = request_records(caplog)
    assert re.fullmatch(r"[0-9a-f]{32}", fields_of(record)["correlation_id"])


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_output_writes_one_json_object_per_line_with_the_fields(
    server: OpsServer, restore_root_logger: None
) -> None:
    stream = io.StringIO()
    configure_logging("info", json_output=True, stream=stream)
    server.stub().Generate(
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="json")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2, min_new_tokens=2)),
        ),
        metadata=[("x-correlation-id", "j-9")],
        timeout=60,
    )
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    (entry,) = [e for e in entries if e["target"] == REQUEST_LOGGER.name]
    assert entry["level"] == "INFO"
    assert entry["fields"]["correlation_id"] == "j-9"
    assert entry["fields"]["generated_tokens"] == 2
    assert "timestamp" in entry and "generated 2 tokens" in entry["message"]


def test_log_level_filters(restore_root_logger: None) -> None:
    stream = io.StringIO()
    configure_logging("warn", stream=stream)
    logging.getLogger("tgis.test").info("quiet")
    logging.getLogger("tgis.test").warning("loud")
    assert "loud" in stream.getvalue() and "quiet" not in stream.getvalue()
    configure_logging("trace", stream=stream)
    logging.getLogger("tgis.test").debug("very verbose")
    assert "very verbose" in stream.getvalue()
