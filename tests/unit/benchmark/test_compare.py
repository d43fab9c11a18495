"""Benchmark runs side by side: ratios to the baseline, speculation where it ran, same-workload check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tgis.benchmark.compare import load, main


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
    assert load("on", on).level(16) is None


def test_runs_of_another_workload_are_refused(tmp_path):
    off = _write(tmp_path / "off", [_level(1, 100.0, 0.01)])
    other = _write(tmp_path / "other", [_level(1, 100.0, 0.01)], fingerprint="xyz")
    with pytest.raises(SystemExit):
        main(["--baseline", f"off={off}", "--run", f"other={other}"])
    with pytest.raises(SystemExit):
        main(["--baseline", f"off={off}", "--run", "missing-equals-sign"])


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
