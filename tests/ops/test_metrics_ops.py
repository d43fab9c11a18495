"""`GET /metrics` beyond TGIS's series: the gauges an emptied batch resets, the process/platform
collectors and the build-info gauge, scraped from a running server on each kind of loop."""

from __future__ import annotations

import pytest

from tests.ops.serving import OpsServer
from tests.ops.test_metrics_scrape import Scrape, fixed_length, parse
from tgis import __version__
from tgis.pb import generation_pb2 as pb


def scrape_after_one_request(server: OpsServer) -> Scrape:
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="one two")], params=fixed_length(6)
    )
    reply = server.stub().Generate(request, timeout=60)
    assert reply.responses[0].generated_token_count == 6
    status, body = server.http_get("/metrics")
    assert status == 200
    return parse(body.decode())


@pytest.mark.parametrize("paged", [False, True], ids=["padded", "paged"])
def test_an_emptied_batch_reports_no_input_tokens(model_dirs, paged: bool) -> None:
    with OpsServer(model_dirs("gpt2"), paged_attention=paged) as server:
        assert server.server.model.engine.spec.paged is paged
        scrape = scrape_after_one_request(server)
    assert scrape.value("tgi_batch_current_size") == 0
    assert scrape.value("tgi_batch_input_tokens") == 0
    assert scrape.value("tgi_batch_inference_count_total", method="next_token") > 0


def test_process_platform_and_build_info_series(model_dirs) -> None:
    model = model_dirs("gpt2")
    with OpsServer(model, paged_attention=False) as server:
        scrape = scrape_after_one_request(server)
        engine = server.server.model.engine.spec.engine_name
    assert scrape.types["process_resident_memory_bytes"] == "gauge"
    assert scrape.value("process_resident_memory_bytes") > 0
    assert scrape.value("process_cpu_seconds_total") > 0
    assert scrape.value("process_start_time_seconds") > 0
    assert scrape.types["python_info"] == "gauge"
    assert scrape.types["python_gc_collections_total"] == "counter"
    assert scrape.labels_of("tgi_build_info") == [
        {"version": __version__, "engine": engine, "dtype": "float32", "model": str(model)}
    ]
    assert (
        scrape.value("tgi_build_info", version=__version__, engine=engine, dtype="float32", model=str(model))
        == 1
    )
