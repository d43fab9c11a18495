"""Conformance cases as data: loading the YAML files and turning a case into concrete requests.

A case names a model and gives its inputs and `params` (an `fmaas.Parameters` message in proto3
JSON, field names as in the .proto). Where a literal would have to be pasted from a model output,
the case says how to derive it instead: an input `{tokens: N}` is a text encoding to exactly N tokens
(specials included), and a stop sequence `{derive: KIND, ...}` is cut out of the greedy reference
output of the same request (see `derive_stop_sequences`), so that what it matches is computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from tests.conformance.oracle import REPLACEMENT, Reference, released_outputs
from tgis.pb import generation_pb2 as pb

CASES_DIR = Path(__file__).with_name("cases")
RPCS = ("Generate", "Tokenize", "ModelInfo", "GenerateStreamWithoutRequest")
PHASES = ("concurrent", "idle")
CASE_KEYS = {
    "name", "about", "rules", "model", "rpc", "inputs", "params", "expect", "phase", "derive_from",
    "prefix_id", "tokenize",
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One named case of a YAML file; see tests/conformance/README.md for the fields."""

    name: str
    about: str
    rules: tuple[str, ...]
    model: str
    file: str
    rpc: str = "Generate"
    inputs: tuple[Any, ...] = ()
    params: dict[str, Any] | None = None
    expect: dict[str, Any] = field(default_factory=dict)
    phase: str = "concurrent"
    derive_from: int = 0  # which input's reference output the stop sequences are derived from
    prefix_id: str | None = None
    tokenize: dict[str, Any] = field(default_factory=dict)

    @property
    def single_input(self) -> bool:
        """Single-input generation cases run both unary and streamed (SPEC §14)."""
        return self.rpc == "Generate" and len(self.inputs) == 1

    @property
    def error(self) -> dict[str, str] | None:
        return self.expect.get("error")


def load_cases(directory: Path = CASES_DIR) -> list[Case]:
    cases: list[Case] = []
    for path in sorted(directory.glob("*.yaml")):
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        for raw in document["cases"]:
            unknown = set(raw) - CASE_KEYS
            if unknown:
                raise ValueError(f"{path.name}: case {raw.get('name')!r} has unknown keys {sorted(unknown)}")
            case = Case(
                name=raw["name"],
                about=raw["about"],
                rules=tuple(str(r) for r in raw["rules"]),
                model=raw.get("model", "gpt2"),
                file=path.name,
                rpc=raw.get("rpc", "Generate"),
                inputs=tuple(raw.get("inputs", ())),
                params=raw.get("params"),
                expect=raw.get("expect") or {},
                phase=raw.get("phase", "concurrent"),
                derive_from=raw.get("derive_from", 0),
                prefix_id=raw.get("prefix_id"),
                tokenize=raw.get("tokenize") or {},
            )
            if case.rpc not in RPCS or case.phase not in PHASES:
                raise ValueError(f"{path.name}: case {case.name!r} has a bad rpc or phase")
            cases.append(case)
    names = [c.name for c in cases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"duplicate case names: {duplicates}")
    return cases


# ---- inputs -------------------------------------------------------------------------------------


def resolve_input(ref: Reference, spec: Any) -> str:
    """A literal string, `{tokens: N}` (exactly N tokens with specials) or `{repeat: S, times: K}`."""
    if isinstance(spec, str):
        return spec
    if "tokens" in spec:
        return text_of_tokens(ref, int(spec["tokens"]))
    if "repeat" in spec:
        return str(spec["repeat"]) * int(spec["times"])
    raise ValueError(f"bad input spec {spec!r}")


def text_of_tokens(ref: Reference, count: int) -> str:
    """A text of repeated words whose encoding (specials included) is exactly `count` tokens."""
    specials = len(ref.encode(""))
    for word in ("and", "a", "the"):
        words = count - specials
        text = " ".join([word] * words)
        if words > 0 and len(ref.encode(text)) == count:
            return text
    raise AssertionError(f"no repeated-word text encodes to {count} tokens for {ref.path.name}")


# ---- parameters ---------------------------------------------------------------------------------


def parameters(params: dict[str, Any] | None) -> pb.Parameters | None:
    return None if params is None else json_format.ParseDict(params, pb.Parameters())


def has_derived_stops(params: dict[str, Any] | None) -> bool:
    stops = ((params or {}).get("stopping") or {}).get("stop_sequences") or []
    return any(isinstance(s, dict) for s in stops)


def with_stop_sequences(params: dict[str, Any], stops: list[str]) -> dict[str, Any]:
    stopping = {**params["stopping"], "stop_sequences": stops}
    return {**params, "stopping": stopping}


def without_stop_sequences(params: dict[str, Any]) -> dict[str, Any]:
    stopping = {k: v for k, v in params["stopping"].items() if k != "stop_sequences"}
    return {**params, "stopping": stopping}


@dataclass(frozen=True)
class _Anchor:
    """Per generated token j: the text it added to the output and the output after it."""

    added: list[str]
    outputs: list[str]

    def first_completed_at(self, text: str, j: int) -> bool:
        before = self.outputs[j - 1] if j else ""
        return bool(text) and text not in before and text in self.outputs[j]


def derive_stop_sequences(ref: Reference, token_ids: Sequence[int], specs: Sequence[Any]) -> list[str]:
    """Replace each `{derive: KIND, from: J, tokens: C}` with text cut out of the reference output.

    KIND, searched from generated token J (default 2) on, for the first place whose text first
    appears there:
      span     the whole text of C consecutive tokens (default 1) each adding printable ASCII
      partial  the same minus its last character, so the match ends inside the last token
      multibyte / emoji   the first non-ASCII (U+FFFD aside) / emoji character of the output
      pair     two sequences both completed by one token: its text without the first character,
               then its text without the last (the later-listed one starts earlier)
      last     the text of the last C generated tokens (a stop completed by the last allowed token)
    """
    outputs = released_outputs(ref.decode, token_ids)
    added = [out[len(outputs[j - 1]) if j else 0 :] for j, out in enumerate(outputs)]
    anchor = _Anchor(added, outputs)
    derived: list[str] = []
    for spec in specs:
        if isinstance(spec, str):
            derived.append(spec)
            continue
        found = _derive(anchor, spec["derive"], int(spec.get("from", 2)), int(spec.get("tokens", 1)))
        if found is None:
            raise AssertionError(f"the reference output {outputs[-1]!r} has no place for {spec}")
        derived += found
    return derived


def _derive(anchor: _Anchor, kind: str, start: int, tokens: int) -> list[str] | None:
    added = anchor.added
    if kind == "last":
        text = "".join(added[-tokens:])
        return [text] if anchor.first_completed_at(text, len(added) - 1) else None
    for j in range(max(start, tokens - 1), len(added)):
        window = added[j - tokens + 1 : j + 1]
        candidates = _candidates(kind, window)
        if candidates and all(anchor.first_completed_at(c, j) for c in candidates):
            return candidates
    return None


def _candidates(kind: str, window: list[str]) -> list[str] | None:
    last = window[-1]
    if kind in ("multibyte", "emoji"):
        wanted = [ch for ch in last if ord(ch) > 127 and ch != REPLACEMENT]
        if kind == "emoji":
            wanted = [ch for ch in wanted if ord(ch) >= 0x1F000 or 0x2600 <= ord(ch) < 0x2800]
        return wanted[:1] or None
    if not all(_printable(text) for text in window):
        return None
    if kind == "span":
        return ["".join(window)]
    if kind == "partial" and len(last) >= 2:
        return ["".join(window)[:-1]]
    if kind == "pair" and len(last) >= 3 and last[1:] != last[:-1]:
        return [last[1:], last[:-1]]
    if kind not in ("span", "partial", "pair"):
        raise ValueError(f"unknown derive kind {kind!r}")
    return None


def _printable(text: str) -> bool:
    return bool(text) and text.isascii() and text.isprintable()
