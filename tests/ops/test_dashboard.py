"""The shipped Grafana dashboard queries only series a running server exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.ops.serving import OpsServer
from tests.ops.test_metrics_scrape import fixed_length, parse
from tgis.pb import generation_pb2 as pb

DASHBOARD = Path(__file__).resolve().parents[2] / "deployment" / "monitoring" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(?:tgi|process|python)_[a-z0-9_]+\b")
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("", "_total"), "gauge": ("",)}


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def exposed_series(server: OpsServer) -> set[str]:
    request = pb.BatchedGenerationRequest(
        requests=[pb.GenerationRequest(text="one two")], params=fixed_length(3)
    )
    server.stub().Generate(request, timeout=60)
    status, body = server.http_get("/metrics")
    assert status == 200
    scrape = parse(body.decode())
    names = {name for name, _ in scrape.samples}
    for family, kind in scrape.types.items():
        names.update(family + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return names


def test_every_metric_the_dashboard_queries_is_exposed(model_dirs) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in queries(dashboard) for name in METRIC.findall(expr)}
    with OpsServer(model_dirs("gpt2")) as server:
        assert server.server.model.engine.spec.paged  # the prefix-cache series are the paged step's
        exposed = exposed_series(server)
    assert used - exposed == set()
    # throughput, latency (time to first token, inter-token), queue, batch, errors, prefix cache: the panels
    # an operator looks for
    for needed in (
        "tgi_request_generated_tokens_sum",
        "tgi_request_duration_bucket",
        "tgi_queue_size",
        "tgi_batch_current_size",
        "tgi_request_failure_total",
        "tgi_prefix_cache_queries_total",
        "tgi_prefix_cache_hits_total",
        "tgi_kv_cache_usage_perc",
        "tgi_request_first_token_duration_bucket",
        "tgi_request_inter_token_duration_bucket",
    ):
        assert needed in used, needed


def test_the_checker_catches_a_misspelled_metric(model_dirs) -> None:
    with OpsServer(model_dirs("gpt2")) as server:
        exposed = exposed_series(server)
    assert "tgi_request_duration_bucket" in exposed
    assert "tgi_request_durations_bucket" not in exposed and "tgi_queue_size_total" not in exposed
