"""Benchmark runs side by side: ratios to the baseline, speculation where it ran, same-workload check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgis_bench.compare.runs import load, main


def _write(directory: Path, runs: list[dict], fingerprint: str = "abc") -> Path:
    directory.mkdir()
    results = {
        "machine": {"cpu": "Test CPU", "cores": 2, "cpu_flags": "avx2", "gpu": None},
        "model": {"name": "demo", "dtype": "float32"},
        "workload": {
            "fingerprint": fingerprint,
            "requests": 8,
            "prompt_tokens": "16:32",
            "new_tokens": "8:8",
        },
        "runs": runs,
    }
    (directory / "results.json").write_text(json.dumps(results))
    return directory


def _level(concurrency: int, tokens_per_second: float, itl: float, speculation: dict | None = None) -> dict:
    return {
        "concurrency": concurrency,
        "tokens_per_second": tokens_per_second,
        "inter_token": {"p50": itl, "p90": itl, "p99": itl},
        "speculation": speculation,
    }


def test_each_level_shows_the_ratio_to_the_baseline_and_the_speculation(tmp_path, capsys):
    off = _write(tmp_path / "off", [_level(1, 100.0, 0.010), _level(4, 300.0, 0.013)])
    on = _write(
        tmp_path / "on",
        [
            _level(1, 180.0, 0.0055, {"acceptance": 0.62, "tokens_per_step": 2.5}),
            _level(4, 291.0, 0.0135, None),
        ],
    )
    out = tmp_path / "REPORT.md"
    assert main(["--baseline", f"off={off}", "--run", f"on={on}", "--title", "Mixed", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("## Mixed") and "Test CPU, 2 cores (avx2)" in text
    assert "| 1 | 100.0 | 180.0 (×1.80) | 10.0 | 5.5 | 62%, 2.50 |" in text
    assert "| 4 | 300.0 | 291.0 (×0.97) | 13.0 | 13.5 | — |" in text
    assert load("on", [on]).levels(16) == [None]


def test_rounds_pair_up_and_each_cell_shows_the_median_with_the_ratios_range(tmp_path, capsys):
    # Three rounds; the machine ran fast in round 2 for both configurations. Each round's ratio counts,
    # not the ratio of the medians: 1.10, 1.05 and 0.90 give a median of 1.05.
    off = [
        _write(tmp_path / f"off{i}", [_level(16, rate, 0.010)])
        for i, rate in enumerate([100.0, 200.0, 120.0])
    ]
    on = [
        _write(tmp_path / f"on{i}", [_level(16, rate, itl, {"acceptance": acc, "tokens_per_step": 3.0})])
        for i, (rate, itl, acc) in enumerate([(110.0, 0.009, 0.7), (210.0, 0.005, 0.8), (108.0, 0.012, 0.9)])
    ]
    joined = ",".join
    assert main(["--baseline", f"off={joined(map(str, off))}", "--run", f"on={joined(map(str, on))}"]) == 0
    text = capsys.readouterr().out
    assert "Median of 3 rounds" in text
    assert "| 16 | 120.0 | 110.0 (×1.05, 0.90–1.10) | 10.0 | 9.0 | 80%, 3.00 |" in text
    with pytest.raises(SystemExit):  # rounds pair up one to one
        main(["--baseline", f"off={joined(map(str, off))}", "--run", f"on={on[0]}"])


def test_runs_of_another_workload_are_refused(tmp_path):
    off = _write(tmp_path / "off", [_level(1, 100.0, 0.01)])
    other = _write(tmp_path / "other", [_level(1, 100.0, 0.01)], fingerprint="xyz")
    with pytest.raises(SystemExit):
        main(["--baseline", f"off={off}", "--run", f"other={other}"])
    with pytest.raises(SystemExit):
        main(["--baseline", f"off={off}", "--run", "missing-equals-sign"])
    with pytest.raises(SystemExit):  # one round of the right workload and one of another
        main(["--baseline", f"off={off}", "--run", f"other={off},{other}"])


def test_runs_that_did_not_speculate_get_no_speculation_columns(tmp_path, capsys):
    before = _write(tmp_path / "before", [_level(32, 500.0, 0.040)])
    after = _write(tmp_path / "after", [_level(32, 510.0, 0.039)])
    results = json.loads((before / "results.json").read_text())
    results["workload"]["shared_prefix_tokens"] = 384
    (before / "results.json").write_text(json.dumps(results))
    assert main(["--baseline", f"before={before}", "--run", f"after={after}"]) == 0
    text = capsys.readouterr().out
    assert "acceptance" not in text and "| 32 | 500.0 | 510.0 (×1.02) | 40.0 | 39.0 |" in text
    assert "prompts of a shared 384-token prefix and 16:32" in text
