"""The tool calls in a model's constrained answer, read as it streams: each call's name once it is
complete, then its arguments' JSON text piece by piece, as OpenAI streams `tool_calls` deltas."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from tgis.http.openai_tools import CALL_STARTS


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # the JSON text the model wrote, as written

    def as_message(self) -> dict[str, object]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallStarted:
    call: ToolCall


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass
class _Call:
    key: str | None = None
    expect_key: bool = True
    name_chars: list[str] = field(default_factory=list)
    in_arguments: bool = False


class ToolCallReader:
    """Reads `{"name": ..., "arguments": ...}` objects, alone or in a JSON array, character by character.

    Knows JSON's lexical structure only (strings, escapes, nesting): the grammar guarantees the rest, so
    spacing and key order do not matter here."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.text = ""
        self._depth = 0
        self._call_depth: int | None = None  # nesting inside a call object: 1 alone, 2 in an array
        self._in_string = False
        self._escaped = False
        self._call: _Call | None = None
        self._string_role: str | None = None  # "key", "name", or None

    def feed(self, text: str) -> list[CallStarted | ArgumentsDelta]:
        events: list[CallStarted | ArgumentsDelta] = []
        if not self.text and text and self._call_depth is None:
            self._call_depth = 2 if text.lstrip().startswith("[") else 1
        self.text += text
        for char in text:
            self._char(char, events)
        return events

    @property
    def complete(self) -> bool:
        """The text is whole JSON whose calls all parsed (their arguments included)."""
        try:
            json.loads(self.text)
            for call in self.calls:
                json.loads(call.arguments)
        except (json.JSONDecodeError, ValueError):
            return False
        return bool(self.calls) and self._depth == 0

    def _char(self, char: str, events: list[CallStarted | ArgumentsDelta]) -> None:
        call = self._call
        if call is not None and call.in_arguments:
            if not self.calls[-1].arguments and not self._in_string and char.isspace():
                return  # the separator's space before the value
            if self._in_string or self._depth > (self._call_depth or 0) or char not in ",}":
                self._lex(char)
                events.append(ArgumentsDelta(len(self.calls) - 1, char))
                self.calls[-1].arguments += char
                return
            call.in_arguments = False
        if self._in_string:
            self._string_char(char, events)
            return
        self._structure(char)

    def _structure(self, char: str) -> None:
        depth = self._depth
        self._lex(char)
        if char == "{" and depth + 1 == self._call_depth:
            self._call = _Call()
            return
        call = self._call
        if call is None or depth != self._call_depth:
            return
        if char == '"':
            self._string_role = "key" if call.expect_key else ("name" if call.key == "name" else None)
            if self._string_role == "key":
                call.key = ""
        elif char == ":":
            call.expect_key = False
            call.in_arguments = call.key == "arguments"
        elif char == ",":
            call.expect_key = True
        elif char == "}":
            self._call = None

    def _string_char(self, char: str, events: list[CallStarted | ArgumentsDelta]) -> None:
        call = self._call
        closing = char == '"' and not self._escaped
        self._lex(char)
        if call is None or self._string_role is None:
            return
        if closing:
            if self._string_role == "name":
                name = json.loads('"' + "".join(call.name_chars) + '"')
                started = ToolCall(len(self.calls), tool_call_id(), name)
                self.calls.append(started)
                events.append(CallStarted(started))
            else:
                call.key = json.loads('"' + (call.key or "") + '"')
            self._string_role = None
        elif self._string_role == "name":
            call.name_chars.append(char)
        else:
            call.key = (call.key or "") + char

    def _lex(self, char: str) -> None:
        """JSON's lexical state: inside a string (with escapes) or the nesting depth."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1


def starts_a_call(text: str) -> bool:
    """Under `auto`, whether the answer took the calls' branch (its first character decides)."""
    return text.startswith(CALL_STARTS)


def read_calls(text: str) -> list[ToolCall] | None:
    """The calls in a finished answer; None when it is no whole call (cut short by max_tokens)."""
    reader = ToolCallReader()
    reader.feed(text)
    return reader.calls if reader.complete else None
