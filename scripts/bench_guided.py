"""Measure grammar engines on the tiny test tokenizer: compile time per constraint, bitmask fill per token.

Run from the repository root with the test extra installed (llguidance is optional):

    python scripts/bench_guided.py [--vocab-size 768] [--repeats 5] [--tokens 64]

Every constraint is compiled `repeats` times from scratch (caches off or a fresh compiler), and then
walked for up to `tokens` steps with a seeded random choice among the allowed tokens; the reported
fill time is the median over those steps of one row's bitmask computation (plus accept).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.tiny import build_tokenizer

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "kind": {"enum": ["cat", "dog"]},
        },
        "required": ["name", "age", "kind"],
        "additionalProperties": False,
    }
)
REGEX = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}( (ok|fail))?"
CONSTRAINTS = {"json_schema": SCHEMA, "regex": REGEX, "any_json": ""}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs"


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = bitmask_row.view(torch.int32).tolist()
    return [t for t in range(vocab) if (bits[t // 32] >> (t % 32)) & 1]


def bench_xgrammar(hf, vocab: int, eos: int, repeats: int, tokens: int) -> dict[str, tuple[float, float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compilers: dict[str, Callable[[xgr.GrammarCompiler, str], xgr.CompiledGrammar]] = {
        "json_schema": lambda c, s: c.compile_json_schema(s),
        "regex": lambda c, s: c.compile_regex(s),
        "any_json": lambda c, s: c.compile_builtin_json_grammar(),
    }
    out = {}
    for kind, text in CONSTRAINTS.items():
        times = []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            started = time.perf_counter()
            compiled = compilers[kind](compiler, text)
            times.append(time.perf_counter() - started)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        rng = random.Random(0)
        fills = []
        for _ in range(tokens):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            fills.append(time.perf_counter() - started)
            choice = rng.choice(_allowed(bitmask[0], vocab))
            if not matcher.accept_token(choice) or matcher.is_terminated():
                break
        out[kind] = (statistics.median(times), statistics.median(fills))
    return out


def bench_llguidance(hf, vocab: int, eos: int, repeats: int, tokens: int) -> dict[str, tuple[float, float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    grammars = {
        "json_schema": llguidance.grammar_from("json_schema", SCHEMA),
        "regex": llguidance.grammar_from("regex", REGEX),
        "any_json": llguidance.grammar_from("json_schema", '{"type": "object"}'),
    }
    out = {}
    for kind, grammar in grammars.items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            # llguidance compiles lazily: the first mask is part of making the matcher usable.
            matcher = llguidance.LLMatcher(tokenizer, grammar)
            bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            if matcher.is_error():
                raise RuntimeError(matcher.get_error())
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        rng = random.Random(0)
        fills = []
        for _ in range(tokens):
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            fills.append(time.perf_counter() - started)
            choice = rng.choice(_allowed(bitmask[0], vocab))
            if not matcher.consume_token(choice) or matcher.is_stopped():
                break
        out[kind] = (statistics.median(times), statistics.median(fills))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf = AutoTokenizer.from_pretrained(build_tokenizer(Path(tmp), "gpt2"))
    vocab, eos = len(hf), hf.eos_token_id
    print(f"tiny gpt2-style tokenizer: vocab {vocab}, eos {eos}, torch {torch.__version__}")
    engines = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance}
    for name, bench in engines.items():
        try:
            results = bench(hf, vocab, eos, args.repeats, args.tokens)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        for kind, (compile_s, fill_s) in results.items():
            print(f"{name:11s} {kind:12s} compile {_ms(compile_s):>10s}   mask fill/token {_ms(fill_s):>8s}")


if __name__ == "__main__":
    main()
