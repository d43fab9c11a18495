"""LOG_LEVEL as TGIS's EnvFilter reads it: a level for every logger, `target=level` for named ones, and
a value that does not parse falls back to info with a warning instead of stopping the start."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from tgis.log_filter import LogFilterError, parse_log_filter
from tgis.logs import configure_logging


@pytest.fixture
def restored_levels() -> Iterator[None]:
    names = ("", "tgis", "tgis.requests", "grpc", "tower", "text_generation_router.server")
    before = {name: logging.getLogger(name).level for name in names}
    handlers = list(logging.getLogger().handlers)
    yield
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


@pytest.mark.parametrize(
    ("value", "default", "targets"),
    [
        ("info", logging.INFO, {}),
        ("WARN", logging.WARNING, {}),
        ("trace", logging.DEBUG, {}),
        ("off", logging.CRITICAL + 10, {}),
        ("3", logging.INFO, {}),
        ("warn,tower=error", logging.WARNING, {"tower": logging.ERROR}),
        ("tgis.requests=debug", logging.ERROR, {"tgis.requests": logging.DEBUG}),
        ("chatty", logging.ERROR, {"chatty": logging.DEBUG}),
        ("error,grpc", logging.ERROR, {"grpc": logging.DEBUG}),
        (
            "text_generation_router::server=warn",
            logging.ERROR,
            {"text_generation_router.server": logging.WARNING},
        ),
    ],
)
def test_directives_parse_as_envfilter_reads_them(value: str, default: int, targets: dict[str, int]) -> None:
    parsed = parse_log_filter(value)
    assert (parsed.default, parsed.targets) == (default, targets)


@pytest.mark.parametrize("value", ["tgis=loud", "", " , ", "tgis[span]=info", "=info"])
def test_what_envfilter_refuses_is_refused(value: str) -> None:
    with pytest.raises(LogFilterError):
        parse_log_filter(value)


def test_directives_set_the_named_python_loggers(restored_levels: None) -> None:
    configure_logging("warn,tgis.requests=info", stream=io.StringIO())
    assert logging.getLogger().level == logging.WARNING
    assert logging.getLogger("tgis.requests").getEffectiveLevel() == logging.INFO
    assert logging.getLogger("tgis").getEffectiveLevel() == logging.WARNING


def test_a_bad_value_logs_at_info_with_a_warning(restored_levels: None) -> None:
    stream = io.StringIO()
    configure_logging("warn,tgis=loud", stream=stream)
    assert logging.getLogger().level == logging.INFO
    expected = "LOG_LEVEL='warn,tgis=loud' is not a valid filter (`loud` in `tgis=loud` is not a level)"
    assert expected + ": logging at info" in stream.getvalue()
