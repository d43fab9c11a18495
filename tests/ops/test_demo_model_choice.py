"""The demo model never hides a misconfiguration: a WARNING on the bare launcher, asked for explicitly
with MODEL_NAME=demo, and refused (one clear line, before any model loads) under REQUIRE_MODEL_NAME."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.ops.test_startup_errors import assert_one_clear_line, start_in_process  # noqa: F401 (a fixture)
from tgis import demo_model
from tgis.config import Settings
from tgis.startup import model as app


@pytest.fixture
def demo_builds(monkeypatch: pytest.MonkeyPatch, model_dirs) -> list[Path]:
    """Stands the tiny gpt2 in for the demo model (building it trains for a while); records builds."""
    built: list[Path] = []
    monkeypatch.delenv("MODEL_NAME", raising=False)
    monkeypatch.delenv("REQUIRE_MODEL_NAME", raising=False)

    def ensure() -> Path:
        built.append(model_dirs("gpt2"))
        return built[-1]

    monkeypatch.setattr(demo_model, "ensure_demo_model", ensure)
    return built


def demo_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if "demo model" in r.getMessage()]


def test_unset_model_name_serves_the_demo_model_with_a_warning(demo_builds, caplog) -> None:
    with caplog.at_level(logging.INFO):
        loaded = app.load_model(Settings(), {"MODEL_NAM": "acme/llama"})
    assert demo_builds == [loaded.path]
    [(level, message)] = demo_lines(caplog)
    assert level == logging.WARNING
    assert "MODEL_NAME is not set" in message
    assert "MODEL_NAM is set: did you mean MODEL_NAME?" in message


def test_model_name_demo_asks_for_the_demo_model_even_where_model_name_is_required(
    demo_builds, caplog
) -> None:
    with caplog.at_level(logging.INFO):
        loaded = app.load_model(Settings(model_name="demo", require_model_name=True), {})
    assert demo_builds == [loaded.path]
    assert [level for level, _ in demo_lines(caplog)] == [logging.INFO]


def test_required_model_name_unset_refuses_before_any_model_loads(
    start_in_process,  # noqa: F811
    demo_builds,
) -> None:
    result = start_in_process(REQUIRE_MODEL_NAME="true", MODLE_NAME="acme/llama")
    assert_one_clear_line(
        result,
        "MODEL_NAME is not set: set it to a model directory or a hub id in the HF cache "
        "(or to `demo` for the built-in demo model); MODLE_NAME is set: did you mean MODEL_NAME?",
    )
    assert demo_builds == []
