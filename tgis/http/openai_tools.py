"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice`, the guided-decoding
constraint that makes the answer a valid call, and the messages the chat template renders.

The model writes a call as OpenAI's own shape, `{"name": <function>, "arguments": {...}}`, and with
`parallel_tool_calls` (OpenAI's default) also a JSON array of such calls. What each `tool_choice` allows:

- `none`: free text, never read as a call;
- `required`: only calls, to any of the tools;
- a named function: exactly one call, to that function;
- `auto`: one branch is the calls above, the other free text that starts with neither `{` nor `[`; the
  first character decides, so any model works without a parser per model family (TGI likewise
  constrains `auto` with a grammar instead of parsing a family's own tags).

In every case with calls the arguments are constrained by the function's `parameters` JSON schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import field_validator

from tgis.errors import ValidationError
from tgis.guided import Constraint
from tgis.http.errors import RequestBody

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
ANY_OBJECT: dict[str, Any] = {"type": "object"}
CALL_STARTS = ("{", "[")  # what only a call may start with under `auto`
ToolMode = Literal["none", "auto", "required", "named"]


class FunctionDefinition(RequestBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema here, strict or not

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not FUNCTION_NAME.fullmatch(name):
            raise ValueError("a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
        return name


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What the request allows: `tools` are all rendered; `callable` are those a call may name."""

    mode: ToolMode
    tools: tuple[ToolDefinition, ...]
    parallel: bool

    @property
    def callable(self) -> tuple[ToolDefinition, ...]:
        return self.tools if self.mode != "named" else self.tools[:1]

    @property
    def calls(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict[Any, Any] | Callable[..., Any]]:
        """The tools as transformers' `apply_chat_template(tools=...)` takes them (JSON schemas)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def tool_plan(
    tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool | None
) -> ToolPlan | None:
    """The request's tools and choice checked (None: no tools); OpenAI's defaults: `auto` when tools
    are given, parallel calls allowed."""
    if not tools:
        if choice is None or choice == "none" or (tools is not None and choice in ("auto", "required")):
            return None  # an empty list calls nothing, as OpenAI (and vLLM) answer `required` over it
        raise ValidationError("tool_choice needs tools: no tools were given")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValidationError(f"tools must have distinct function names, got {', '.join(names)}")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise ValidationError(f"tool_choice names the function {name!r}, which is not among tools")
        chosen = tools[names.index(name)]
        rest = tuple(t for t in tools if t is not chosen)
        return ToolPlan("named", (chosen, *rest), parallel=False)
    return ToolPlan(choice or "auto", tuple(tools), parallel=True if parallel is None else parallel)


def tool_constraint(plan: ToolPlan) -> Constraint | None:
    """The guided-decoding constraint of the calls the plan allows (None under `none`)."""
    if not plan.calls:
        return None
    defs: dict[str, Any] = {}
    calls = [_call_schema(tool.function, defs) for tool in plan.callable]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]} if plan.parallel else one
    if defs:
        schema = {**schema, "$defs": defs}
    return Constraint("tools_or_text" if plan.mode == "auto" else "tools", json.dumps(schema))


def _call_schema(function: FunctionDefinition, defs: dict[str, Any]) -> dict[str, Any]:
    """`{"name": <this function>, "arguments": <its parameters>}`; the parameters' `$defs` move to the
    root, where their `#/$defs/...` references point once the schema is nested."""
    parameters = dict(function.parameters or ANY_OBJECT)
    for name, definition in (parameters.pop("$defs", None) or {}).items():
        if defs.setdefault(name, definition) != definition:
            raise ValidationError(f"tools define $defs/{name} twice, differently")
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: an assistant's earlier calls carry their arguments
    as objects (OpenAI sends them as JSON text)."""
    rendered = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is not None:
            message = {**message, "tool_calls": [_template_call(i, j, c) for j, c in enumerate(calls)]}
        rendered.append(message)
    return rendered


def _template_call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages.{i}.tool_calls.{j}"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValidationError(f"{where}.function must be an object with a name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"{where}.function.arguments is not valid JSON: {exc}") from exc
    return {**call, "function": {**function, "arguments": arguments}}
