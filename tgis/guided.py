"""Guided decoding constraints: read from the request, compiled by xgrammar off the engine loop, cached.

The front doors turn a request's constraint (gRPC's `DecodingParameters.guided`, OpenAI's
`response_format`, TGI's `grammar`) into a `Constraint` and ask `GrammarCache.compile`
for the compiled grammar during validation: compilation runs in a worker thread under a timeout,
and compiled grammars are kept in a bounded LRU keyed by (kind, text, tokenizer). The sampler only
ever sees the compiled grammar (`tgis.sampling.guide` makes a matcher per row from it).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from tgis.errors import Msg, ValidationError
from tgis.json_grammar import json_schema_grammar
from tgis.metrics import Metrics

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_SECONDS = 10.0
ANY_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Tool calling's `auto`: the text branch, any text (or none) whose first character cannot start a call.
TEXT_NOT_A_CALL = 'root ::= "" | [^{\\[] [^]*'
# xgrammar prefixes its C++ errors with "[hh:mm:ss] file.cc:line: " and sometimes a failed check.
_ERROR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: `kind` is the proto field name, `text` what gets compiled."""

    # format | json_schema | regex | choice | grammar; tools (a JSON schema of the calls), tools_or_text
    # (those calls, or text that starts with neither `{` nor `[`)
    kind: str
    text: str


def choice_constraint(choices: Sequence[str]) -> Constraint:
    """Exactly one of `choices` (at least two: SPEC's message otherwise)."""
    if len(choices) < 2:
        raise ValidationError(Msg.GUIDED_CHOICES)
    return Constraint("choice", _choice_ebnf(choices))


def json_schema_constraint(schema: dict[str, object] | str) -> Constraint:
    """A JSON schema given as an object or as its JSON text (the HTTP APIs take both)."""
    return Constraint("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def _choice_ebnf(choices: Sequence[str]) -> str:
    """Exactly one of the strings: JSON string escapes are valid xgrammar EBNF literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiles constraints against one tokenizer's vocabulary; a bounded LRU of compiled grammars."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        tokenizer_key: str = "",
        max_entries: int = DEFAULT_CACHE_SIZE,
        timeout_seconds: float = DEFAULT_COMPILE_TIMEOUT_SECONDS,
        metrics: Metrics | None = None,
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # xgrammar's own cache is off: this class bounds entries and counts hits itself.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.tokenizer_key = tokenizer_key
        self.max_entries = max_entries
        self.timeout_seconds = timeout_seconds
        self._entries: OrderedDict[tuple[str, str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._metrics = metrics

    def __len__(self) -> int:
        return len(self._entries)

    async def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar, from the cache or compiled in a worker thread under the timeout."""
        key = (constraint.kind, constraint.text, self.tokenizer_key)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self._count("hit")
                return found
            self.misses += 1
        self._count("miss")
        started = time.monotonic()
        try:
            compiled = await asyncio.wait_for(
                asyncio.to_thread(self._compile, constraint), timeout=self.timeout_seconds
            )
        except TimeoutError as exc:
            # The worker thread cannot be interrupted; it finishes in the background and is dropped.
            raise ValidationError(
                Msg.GUIDED_TIMEOUT.format(field=constraint.kind, seconds=self.timeout_seconds)
            ) from exc
        with self._lock:
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            size = len(self._entries)
        if self._metrics is not None:
            self._metrics.guided_grammar_compile_duration.observe(time.monotonic() - started)
            self._metrics.guided_grammar_cache_size.set(size)
        return compiled

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.guided_grammar_cache.labels(result=result).inc()

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        compiler = self._compiler
        try:
            if constraint.kind in ("format", "json_schema", "tools"):
                return compiler.compile_grammar(json_schema_grammar(constraint.text))
            if constraint.kind == "tools_or_text":
                calls = json_schema_grammar(constraint.text)
                return compiler.compile_grammar(
                    xgr.Grammar.union(calls, xgr.Grammar.from_ebnf(TEXT_NOT_A_CALL))
                )
            if constraint.kind == "regex":
                return compiler.compile_regex(constraint.text)
            return compiler.compile_grammar(constraint.text)  # grammar, and choice as EBNF
        except (RuntimeError, ValueError) as exc:
            raise ValidationError(
                Msg.GUIDED_INVALID.format(field=constraint.kind, error=_engine_error(exc))
            ) from exc


def _engine_error(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        # xgrammar (0.2.8, 0.2.9) cuts its error text inside a multi-byte character when it quotes the input,
        # and the binding then fails to decode it: the position is lost, the verdict is not.
        return "the text does not parse"
    return _ERROR_PREFIX.sub("", str(exc)).strip()
