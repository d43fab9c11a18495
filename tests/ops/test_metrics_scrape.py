"""`GET /metrics` after a scripted workload: values, labels and histogram counts, bare and `_total` names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from tests.ops.serving import OpsServer
from tgis.pb import generation_pb2 as pb

SPEC_METRICS = {
    "tgi_request_count": "counter",
    "tgi_request_input_count": "counter",
    "tgi_request_failure": "counter",
    "tgi_request_success": "counter",
    "tgi_request_max_new_tokens": "histogram",
    "tgi_request_input_length": "histogram",
    "tgi_request_raw_input_length": "histogram",
    "tgi_request_validation_duration": "histogram",
    "tgi_request_queue_duration": "histogram",
    "tgi_request_inference_duration": "histogram",
    "tgi_request_mean_time_per_token_duration": "histogram",
    "tgi_request_generated_tokens": "histogram",
    "tgi_request_total_tokens": "histogram",
    "tgi_request_duration": "histogram",
    "tgi_batch_concatenation_count": "counter",
    "tgi_batch_inference_count": "counter",
    "tgi_batch_inference_success": "counter",
    "tgi_batch_inference_failure": "counter",
    "tgi_batch_inference_batch_size": "histogram",
    "tgi_batch_inference_duration": "histogram",
    "tgi_batch_inference_forward_duration": "histogram",
    "tgi_batch_inference_tokproc_duration": "histogram",
    "tgi_batch_next_tokens": "histogram",
    "tgi_batch_current_size": "gauge",
    "tgi_batch_input_tokens": "gauge",
    "tgi_batch_max_remaining_tokens": "gauge",
    "tgi_queue_size": "gauge",
    "tgi_queue_jump": "counter",
    "tgi_granular_batch_addition": "counter",
    "tgi_prefill_weight_limit_exceeded": "counter",
    "tgi_prefill_padding_limit_exceeded": "counter",
    "tgi_prompt_load_failure": "counter",
    "tgi_prompt_load_duration": "histogram",
    "tgi_tokenize_request_count": "counter",
    "tgi_tokenize_request_input_count": "counter",
    "tgi_tokenize_request_tokens": "histogram",
    "tgi_tokenize_request_duration": "histogram",
}
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
MAX_BATCH_SIZE = 4


@dataclass(frozen=True)
class Scrape:
    types: dict[str, str]
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for sample, labels in self.samples if sample == name]


def parse(text: str) -> Scrape:
    """A plain reading of the text format: prometheus-client's own parser folds bare names into _total."""
    types: dict[str, str] = {}
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"two TYPE lines for {name}"
            types[name] = kind
        elif line and not line.startswith("#"):
            match = SAMPLE.match(line)
            assert match, line
            labels = frozenset(LABEL.findall(match["labels"] or ""))
            samples[(match["name"], labels)] = float(match["value"])
    return Scrape(types, samples)


def fixed_length(max_new_tokens: int) -> pb.Parameters:
    return pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    )


@pytest.fixture(scope="module")
def scrape(model_dirs) -> Iterator[Scrape]:
    """One fresh server, a known workload, one scrape."""
    with OpsServer(model_dirs("gpt2"), max_batch_size=MAX_BATCH_SIZE) as server:
        stub = server.stub()
        stub.Generate(
            pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="one")], params=fixed_length(5)),
            timeout=60,
        )
        stub.Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="two"), pb.GenerationRequest(text="three four")],
                params=fixed_length(3),
            ),
            timeout=60,
        )
        list(
            stub.GenerateStream(
                pb.SingleGenerationRequest(request=pb.GenerationRequest(text="five"), params=fixed_length(4)),
                timeout=60,
            )
        )
        with pytest.raises(grpc.RpcError):  # min_new_tokens > max_new_tokens: a validation failure
            stub.Generate(
                pb.BatchedGenerationRequest(
                    requests=[pb.GenerationRequest(text="six")],
                    params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=2, min_new_tokens=3)),
                ),
                timeout=60,
            )
        stub.Tokenize(
            pb.BatchedTokenizeRequest(
                requests=[pb.TokenizeRequest(text="a"), pb.TokenizeRequest(text="b c")]
            ),
            timeout=60,
        )
        status, body = server.http_get("/metrics")
        assert status == 200
        yield parse(body.decode())


def test_every_spec_metric_is_exported_with_its_kind(scrape: Scrape) -> None:
    for name, kind in SPEC_METRICS.items():
        exported = scrape.types.get(name + "_total" if kind == "counter" else name)
        assert exported == kind, f"{name}: {exported}"


def test_every_counter_is_also_exported_under_its_bare_name(scrape: Scrape) -> None:
    counters = [name for name, kind in SPEC_METRICS.items() if kind == "counter"]
    for name in counters:
        assert scrape.types.get(name) == "counter", name
        for labels in scrape.labels_of(name + "_total"):
            assert scrape.value(name, **labels) == scrape.value(name + "_total", **labels), (name, labels)
    assert scrape.value("tgi_request_count", kind="single") == 2


def test_request_counters_count_calls_inputs_failures_and_successes(scrape: Scrape) -> None:
    assert scrape.value("tgi_request_count_total", kind="single") == 2
    assert scrape.value("tgi_request_count_total", kind="batch") == 1
    assert scrape.value("tgi_request_count_total", kind="stream") == 1
    assert scrape.value("tgi_request_input_count_total") == 5
    assert scrape.labels_of("tgi_request_failure_total") == [{"err": "validation"}]
    assert scrape.value("tgi_request_failure_total", err="validation") == 1
    assert scrape.value("tgi_request_success_total", stop_reason="MAX_TOKENS", kind="single") == 1
    assert scrape.value("tgi_request_success_total", stop_reason="MAX_TOKENS", kind="batch") == 2
    assert scrape.value("tgi_request_success_total", stop_reason="MAX_TOKENS", kind="stream") == 1


def test_request_histograms_count_each_completed_input(scrape: Scrape) -> None:
    for name in (
        "tgi_request_generated_tokens",
        "tgi_request_total_tokens",
        "tgi_request_queue_duration",
        "tgi_request_inference_duration",
        "tgi_request_mean_time_per_token_duration",
        "tgi_request_input_length",
        "tgi_request_max_new_tokens",
        "tgi_request_duration",  # per input, as TGIS's router records it
    ):
        assert scrape.value(name + "_count") == 4, name
    assert scrape.value("tgi_request_generated_tokens_sum") == 5 + 3 + 3 + 4
    assert scrape.value("tgi_request_max_new_tokens_sum") == 5 + 3 + 3 + 4
    assert scrape.value("tgi_request_validation_duration_count") == 3  # per call that validated
    assert scrape.value("tgi_request_raw_input_length_count") == 4


def test_batch_metrics_count_forward_passes_by_method(scrape: Scrape) -> None:
    # Calls ran one after another: a prefill each (the two-input batch together), then decode steps.
    assert scrape.value("tgi_batch_inference_count_total", method="prefill") == 3
    assert scrape.value("tgi_batch_inference_success_total", method="prefill") == 3
    assert scrape.value("tgi_batch_inference_count_total", method="next_token") == 4 + 2 + 3
    assert scrape.value("tgi_batch_inference_success_total", method="next_token") == 4 + 2 + 3
    assert scrape.labels_of("tgi_batch_inference_failure_total") == []
    assert scrape.value("tgi_batch_inference_batch_size_count", method="prefill") == 3
    assert scrape.value("tgi_batch_inference_batch_size_sum", method="prefill") == 1 + 2 + 1
    assert scrape.value("tgi_batch_inference_batch_size_bucket", method="prefill", le="1.0") == 2
    assert scrape.value("tgi_batch_inference_batch_size_bucket", method="prefill", le="2.0") == 3
    duration = {"method": "next_token", "makeup": "single_only"}
    assert scrape.value("tgi_batch_inference_duration_count", **duration) == 9
    assert scrape.value("tgi_batch_inference_forward_duration_count", **duration) == 9
    assert scrape.value("tgi_batch_inference_tokproc_duration_count", **duration) == 9
    assert scrape.value("tgi_batch_next_tokens_count") == 3
    assert scrape.value("tgi_batch_concatenation_count_total") == 0
    assert scrape.value("tgi_queue_size") == 0
    assert scrape.value("tgi_batch_current_size") == 0


def test_tokenize_metrics(scrape: Scrape) -> None:
    assert scrape.value("tgi_tokenize_request_count_total") == 1
    assert scrape.value("tgi_tokenize_request_input_count_total") == 2
    assert scrape.value("tgi_tokenize_request_tokens_count") == 1
    assert scrape.value("tgi_tokenize_request_duration_count") == 1


def test_buckets_follow_the_spec(scrape: Scrape) -> None:
    def bounds(name: str, **labels: str) -> list[str]:
        found = [
            dict(key)["le"]
            for sample, key in scrape.samples
            if sample == name + "_bucket" and dict(key).items() >= labels.items()
        ]
        return sorted(found, key=float)

    duration = bounds("tgi_request_duration")
    assert len(duration) == 36 and duration[-1] == "+Inf"
    assert float(duration[0]) == pytest.approx(0.00015) and float(duration[-2]) == pytest.approx(
        0.0001 * 1.5**35
    )
    assert [float(b) for b in bounds("tgi_batch_inference_batch_size", method="prefill")[:-1]] == [
        1.0,
        2.0,
        3.0,
        4.0,
    ]
    tokens = [float(b) for b in bounds("tgi_tokenize_request_tokens")[:-1]]
    assert tokens == [float(2**k) for k in range(6, 20)]
    generated = [float(b) for b in bounds("tgi_request_generated_tokens")[:-1]]
    assert len(generated) == 64 and generated[-1] == pytest.approx(255)  # max_new_tokens = 256 - 1
    input_length = [float(b) for b in bounds("tgi_request_input_length")[:-1]]
    assert len(input_length) == 64 and input_length[-1] == pytest.approx(256)


def test_no_created_series_are_exported(scrape: Scrape) -> None:
    assert not [name for name, _ in scrape.samples if name.endswith("_created")]


def test_max_new_tokens_is_recorded_as_requested_not_as_clamped(model_dirs) -> None:
    """TGIS's router observes the max_new_tokens a request asked for; the clamp to the sequence length
    shows in the stop reason (TOKEN_LIMIT), not in the histogram."""
    with OpsServer(model_dirs("gpt2"), max_sequence_length=16) as server:
        reply = server.stub().Generate(
            pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="one two three four")],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=14)),
            ),
            timeout=60,
        )
        assert reply.responses[0].stop_reason == pb.TOKEN_LIMIT
        _, body = server.http_get("/metrics")
    scraped = parse(body.decode())
    assert scraped.value("tgi_request_max_new_tokens_count") == 1
    assert scraped.value("tgi_request_max_new_tokens_sum") == 14
