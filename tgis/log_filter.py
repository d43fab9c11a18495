"""LOG_LEVEL as TGIS reads it: a tracing `EnvFilter` directive list, applied to Python's loggers.

`warn,tgis.requests=info,grpc=error`: comma-separated directives; a bare level is the default for every
logger (tgis's included), `target=level` sets the logger named `target` (Rust's `a::b` reads as `a.b`),
and a bare target means `target=trace`. Without a bare level, loggers no directive names log errors only
(EnvFilter's default directive). Span and field filters (`target[span{field}]=level`) have no Python
counterpart: such a directive is refused. A value that does not parse falls back to `info`, as
TGIS's `EnvFilter::try_from_env(...).unwrap_or_else(|_| EnvFilter::new("info"))` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

# EnvFilter's level names (case-insensitive) and its numeric forms, plus Python's own spellings.
LEVEL_NAMES = {
    "off": logging.CRITICAL + 10,
    "0": logging.CRITICAL + 10,
    "error": logging.ERROR,
    "1": logging.ERROR,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "2": logging.WARNING,
    "info": logging.INFO,
    "3": logging.INFO,
    "debug": logging.DEBUG,
    "4": logging.DEBUG,
    "trace": logging.DEBUG,
    "5": logging.DEBUG,
    "critical": logging.CRITICAL,
}
FALLBACK = "info"


class LogFilterError(ValueError):
    """LOG_LEVEL does not parse as a directive list; the message says which part."""


@dataclass(frozen=True)
class LogFilter:
    """The default level for every logger, and the levels of named loggers."""

    default: int = logging.INFO
    targets: dict[str, int] = field(default_factory=dict)

    def apply(self) -> None:
        logging.getLogger().setLevel(self.default)
        for name, level in self.targets.items():
            logging.getLogger(name).setLevel(level)


def parse_log_filter(value: str) -> LogFilter:
    """The filter a LOG_LEVEL value names, or LogFilterError saying why it is not one."""
    default: int | None = None
    targets: dict[str, int] = {}
    directives = [part.strip() for part in value.split(",")]
    if not any(directives):
        raise LogFilterError("it is empty")
    for directive in directives:
        if not directive:
            continue
        if any(mark in directive for mark in "[]{}"):
            raise LogFilterError(f"`{directive}` filters spans or fields, which Python logging has not")
        target, has_level, level_name = directive.partition("=")
        if not has_level:
            if target.lower() in LEVEL_NAMES:
                default = LEVEL_NAMES[target.lower()]
                continue
            level_name = "trace"
        level = LEVEL_NAMES.get(level_name.strip().lower())
        if level is None:
            raise LogFilterError(f"`{level_name}` in `{directive}` is not a level")
        name = target.strip().replace("::", ".")
        if not name:
            raise LogFilterError(f"`{directive}` names no target")
        targets[name] = level
    return LogFilter(logging.ERROR if default is None else default, targets)


def log_filter_or_info(value: str) -> tuple[LogFilter, str | None]:
    """The filter, or info's with the warning to log about the value (TGIS falls back silently)."""
    try:
        return parse_log_filter(value), None
    except LogFilterError as exc:
        warning = f"LOG_LEVEL={value!r} is not a valid filter ({exc}): logging at info"
        return parse_log_filter(FALLBACK), warning
