"""The weights tools of `text-generation-server` (SPEC §10): download, safetensors, fast tokenizer."""

from __future__ import annotations


class WeightsError(Exception):
    """An operator error of the weights tools: its message is the one line the command prints."""


def one_line(error: BaseException) -> str:
    """A library's (often multi-line) error message folded onto one line."""
    return " ".join(str(error).split()) or type(error).__name__
