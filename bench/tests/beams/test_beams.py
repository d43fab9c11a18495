"""`tgis-bench beams` against a real server: both modes run, and the report reads their samples."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.harness import ServerThread
from tgis_bench.beams.cli import Sample, main, summarize


def test_the_beam_cost_is_the_ratio_of_request_rates_per_round() -> None:
    samples = [
        Sample(0, "greedy", 1, 2.0, 4, (0.5,)), Sample(0, "beams", 1, 8.0, 4, (2.0,)),
        Sample(1, "greedy", 1, 2.0, 4, (0.5,)), Sample(1, "beams", 1, 4.0, 4, (1.0,)),
    ]  # fmt: skip
    (row,) = summarize(samples, [1])
    assert row.beam_cost == 3.0 and row.beam_cost_range == (2.0, 4.0)
    assert row.greedy_requests_per_second == 2.0 and row.beam_latency_p50 == 1.5


def test_the_command_drives_both_modes_and_writes_its_report(model_dirs, tmp_path: Path) -> None:
    model_dir = model_dirs("gpt2")
    server = ServerThread(model_dir)
    try:
        url = f"http://127.0.0.1:{server.server.http_port}"
        args = ["--url", url, "--model-dir", str(model_dir), "--concurrency", "1,2", "--requests", "2"]
        assert main([*args, "--new-tokens", "3", "--rounds", "2", "--out", str(tmp_path)]) == 0
    finally:
        server.stop()
    data = json.loads((tmp_path / "results.json").read_text())
    assert {(s["mode"], s["concurrency"]) for s in data["samples"]} == {
        ("greedy", 1),
        ("beams", 1),
        ("greedy", 2),
        ("beams", 2),
    }
    assert [row["concurrency"] for row in data["rows"]] == [1, 2] and data["peer"]["beams"] > 0
    assert "4 beams" in (tmp_path / "REPORT.md").read_text()
