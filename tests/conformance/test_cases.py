"""Runs every YAML case against real servers: all at once, in random order, single inputs also streamed.

The calls of every `phase: concurrent` case go out together, each on its own thread, in an order
shuffled with a seed printed on failure, so the server batches them as it likes; batching must not
change any answer. `phase: idle` cases (time limits) run afterwards one at a time. Each case then
checks its answers in its own test, against expectations computed from transformers.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest

from tests.conformance import cases as case_data
from tests.conformance.cases import Case
from tests.conformance.checks import (
    Problems,
    StreamShape,
    check_stream,
    compare_unary,
    reason,
)
from tests.conformance.conftest import PrefixStore
from tests.conformance.expected import (
    MAX_NEW_TOKENS,
    MAX_SEQUENCE_LENGTH,
    Effective,
    Expected,
    Prompt,
    expected_from_tokens,
    expected_greedy,
    greedy_generation,
    outside_support,
)
from tests.conformance.oracle import REPLACEMENT, Outcome, Prefix, Reference
from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb

CASES = case_data.load_cases()
CALL_TIMEOUT_SECONDS = 180.0
FINISHED_REASONS = {"MAX_TOKENS", "EOS_TOKEN", "STOP_SEQUENCE", "TOKEN_LIMIT", "TIME_LIMIT"}


@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    details: str


@dataclass
class Resolved:
    """A case made concrete: texts, the final `Parameters` (derived stop sequences filled in), prompts."""

    case: Case
    ref: Reference
    texts: list[str]
    params: pb.Parameters | None
    effective: Effective
    prefix: Prefix | None = None  # the store entry `prefix_id` names, as the oracle prepends it
    problem: str | None = None  # the case could not be made concrete

    @property
    def modes(self) -> tuple[str, ...]:
        return ("unary", "stream") if self.case.single_input else ("unary",)

    @property
    def prompts(self) -> list[Prompt]:
        return [Prompt.of(self.ref, text, self.effective, self.prefix) for text in self.texts]

    def request(self, mode: str) -> Any:
        case, params = self.case, self.params
        extra: dict[str, Any] = {"params": params} if params is not None else {}
        if case.prefix_id is not None:
            extra["prefix_id"] = case.prefix_id
        if case.rpc == "Tokenize":
            return pb.BatchedTokenizeRequest(
                requests=[pb.TokenizeRequest(text=t) for t in self.texts], **case.tokenize
            )
        if case.rpc == "ModelInfo":
            return pb.ModelInfoRequest(model_id="ignored")
        if case.rpc == "GenerateStreamWithoutRequest":
            return pb.SingleGenerationRequest(**extra)
        if mode == "stream":
            return pb.SingleGenerationRequest(request=pb.GenerationRequest(text=self.texts[0]), **extra)
        return pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=t) for t in self.texts], **extra
        )


def resolve(case: Case, ref: Reference, prefixes: dict[str, Prefix]) -> Resolved:
    try:
        return _resolve(case, ref, prefixes)
    except AssertionError as error:  # reported by the case's own test, not by the whole run
        return Resolved(case, ref, [], None, Effective.of(None), problem=str(error))


def _resolve(case: Case, ref: Reference, prefixes: dict[str, Prefix]) -> Resolved:
    """`prefixes`: what the store holds for the case's model (an unknown id is fine in error cases)."""
    prefix = prefixes.get(case.prefix_id) if case.prefix_id else None
    assert prefix is not None or not case.prefix_id or case.error is not None, (
        f"prefix id {case.prefix_id!r} is not in the suite's store for {case.model}"
    )
    texts = [case_data.resolve_input(ref, spec) for spec in case.inputs]
    params = case.params
    if case_data.has_derived_stops(params):
        assert params is not None
        base = Effective.of(case_data.parameters(case_data.without_stop_sequences(params)))
        token_ids, _ = greedy_generation(ref, Prompt.of(ref, texts[case.derive_from], base, prefix), base)
        stops = case_data.derive_stop_sequences(ref, token_ids, params["stopping"]["stop_sequences"])
        params = case_data.with_stop_sequences(params, stops)
    message = case_data.parameters(params)
    return Resolved(case, ref, texts, message, Effective.of(message), prefix)


def perform(stub: Any, resolved: Resolved, mode: str) -> Any:
    rpc = resolved.case.rpc
    request = resolved.request(mode)
    try:
        if rpc == "Tokenize":
            return stub.Tokenize(request, timeout=CALL_TIMEOUT_SECONDS)
        if rpc == "ModelInfo":
            return stub.ModelInfo(request, timeout=CALL_TIMEOUT_SECONDS)
        if rpc == "GenerateStreamWithoutRequest" or mode == "stream":
            return list(stub.GenerateStream(request, timeout=CALL_TIMEOUT_SECONDS))
        return stub.Generate(request, timeout=CALL_TIMEOUT_SECONDS)
    except grpc.RpcError as error:
        return Failure(error.code(), error.details())


@dataclass
class SuiteRun:
    resolved: dict[str, Resolved]
    results: dict[tuple[str, str], Any]
    order_seed: int


@pytest.fixture(scope="module")
def suite_run(
    suite_servers: dict[str, ServerThread], suite_refs: dict[str, Reference], prefix_store: PrefixStore
) -> SuiteRun:
    resolved = {
        case.name: resolve(case, suite_refs[case.model], prefix_store.prefixes[case.model]) for case in CASES
    }
    calls = [(r, mode) for r in resolved.values() if r.problem is None for mode in r.modes]
    order_seed = random.randrange(2**32)
    concurrent = [c for c in calls if c[0].case.phase == "concurrent"]
    random.Random(order_seed).shuffle(concurrent)
    results: dict[tuple[str, str], Any] = {}

    def run(r: Resolved, mode: str) -> None:
        results[(r.case.name, mode)] = perform(suite_servers[r.case.model].stub, r, mode)

    threads = [threading.Thread(target=run, args=call, daemon=True) for call in concurrent]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_TIMEOUT_SECONDS + 10)
    for r, mode in calls:
        if r.case.phase == "idle":
            run(r, mode)
    return SuiteRun(resolved, results, order_seed)


@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_conformance_case(name: str, suite_run: SuiteRun) -> None:
    r = suite_run.resolved[name]
    case = r.case
    problems = Problems()
    results: dict[str, Any] = {mode: suite_run.results.get((name, mode)) for mode in r.modes}
    if r.problem is not None:
        problems.append(f"cannot build the request: {r.problem}")
    elif case.error is not None:
        for mode, result in results.items():
            _check_error(problems, mode, result, case.error)
    elif _failed(problems, results):
        pass
    elif case.rpc == "Tokenize":
        _check_tokenize(problems, r, results["unary"])
    elif case.rpc == "ModelInfo":
        _check_model_info(problems, r, results["unary"])
    else:
        _check_generation(problems, r, results)
    header = f"case {name!r} ({case.file}): {case.about}\n  request params: {r.params}\n  "
    assert not problems, header + "\n  ".join(problems) + f"\n  (call order seed {suite_run.order_seed})"


def _failed(problems: Problems, results: dict[str, Any]) -> bool:
    for mode, result in results.items():
        if result is None:
            problems.append(f"{mode}: no answer within the deadline")
        elif isinstance(result, Failure):
            problems.append(f"{mode}: failed with {result.code.name}: {result.details}")
    return bool(problems)


def _check_error(problems: Problems, mode: str, result: Any, error: dict[str, str]) -> None:
    if not isinstance(result, Failure):
        problems.append(f"{mode}: expected {error['code']} but the call succeeded: {result}")
        return
    problems.equal(f"{mode}: status", result.code.name, error["code"])
    problems.equal(f"{mode}: message", result.details, error["message"])


# ---- Tokenize and ModelInfo (SPEC §2.7) ---------------------------------------------------------


def _check_tokenize(problems: Problems, r: Resolved, answer: pb.BatchedTokenizeResponse) -> None:
    options = r.case.tokenize
    problems.equal("number of responses", len(answer.responses), len(r.texts))
    for i, (text, response) in enumerate(zip(r.texts, answer.responses, strict=False)):
        encoded = r.ref.tokenizer(text, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        truncate = options.get("truncate_input_tokens", 0)
        count = min(len(ids), truncate) if truncate > 0 else len(ids)
        start = len(ids) - count
        problems.equal(f"input {i}: token_count", response.token_count, count)
        tokens = r.ref.raw(ids)[start:] if options.get("return_tokens") else []
        problems.equal(f"input {i}: tokens", list(response.tokens), tokens)
        specials = set(r.ref.tokenizer.all_special_ids)
        offsets = [
            (0, 0) if token in specials else (len(text[:a].encode()), len(text[:b].encode()))
            for token, (a, b) in zip(ids, encoded["offset_mapping"], strict=True)
        ]
        expected = offsets[start:] if options.get("return_offsets") else []
        problems.equal(f"input {i}: offsets", [(o.start, o.end) for o in response.offsets], expected)


def _check_model_info(problems: Problems, r: Resolved, answer: pb.ModelInfoResponse) -> None:
    kind = (
        pb.ModelInfoResponse.ENCODER_DECODER if r.ref.encoder_decoder else pb.ModelInfoResponse.DECODER_ONLY
    )
    problems.equal("model_kind", answer.model_kind, kind)
    problems.equal("max_sequence_length", answer.max_sequence_length, MAX_SEQUENCE_LENGTH)
    problems.equal("max_new_tokens", answer.max_new_tokens, MAX_NEW_TOKENS)


# ---- Generate / GenerateStream (SPEC §2, §4, §5) ------------------------------------------------


def _check_generation(problems: Problems, r: Resolved, results: dict[str, Any]) -> None:
    unary: pb.BatchedGenerationResponse = results["unary"]
    problems.equal("number of responses", len(unary.responses), len(r.texts))
    prompts = r.prompts
    expectations: list[Expected | None] = []
    for i, (prompt, response) in enumerate(zip(prompts, unary.responses, strict=False)):
        where = f"unary input {i}"
        expected = _expectation(problems, r, prompt, response, where)
        expectations.append(expected)
        _check_seed(problems, where, r.effective, response.seed)
        if expected is None:
            _check_plausible(problems, where, prompt, response)
        else:
            compare_unary(problems, where, response, expected, _echo(r, prompt))
        _check_claims(problems, where, r, prompt, response, expected, _claims_for(r.case, i))
    _check_batch_claims(problems, r.case.expect, list(unary.responses))
    if "stream" in results:
        _check_stream_run(
            problems, r, prompts[0], results["stream"], expectations[0] if expectations else None
        )


def _expectation(
    problems: Problems, r: Resolved, prompt: Prompt, response: pb.GenerationResponse, where: str
) -> Expected | None:
    """The reference answer; for sampling and time limits it judges the tokens the server chose."""
    effective, ref = r.effective, r.ref
    if reason(response.stop_reason) == "TIME_LIMIT":
        n = response.generated_token_count
        problems.check(n >= 1, f"{where}: a time-limited request produced no token")
        token_ids = (
            _server_tokens(r, response)
            if not effective.greedy
            else greedy_generation(ref, prompt, effective)[0][:n]
        )
        return expected_from_tokens(ref, prompt, effective, token_ids, time_limited=True)
    if effective.greedy:
        return expected_greedy(ref, prompt, effective)
    if effective.generated is None:
        return None
    token_ids = _server_tokens(r, response)
    outside = outside_support(ref, prompt, effective, token_ids)
    problems.check(not outside, f"{where}: sampled tokens at {outside} have probability 0 after the warpers")
    return expected_from_tokens(ref, prompt, effective, token_ids)


def _server_tokens(r: Resolved, response: pb.GenerationResponse) -> list[int]:
    return [r.ref.token_id(t.text) for t in response.tokens]


def _echo(r: Resolved, prompt: Prompt) -> str:
    if not r.effective.input_text:
        return ""
    return prompt.text + ("\n\n" if r.ref.encoder_decoder else "")


def _check_seed(problems: Problems, where: str, effective: Effective, seed: int) -> None:
    if effective.greedy:
        problems.equal(f"{where}: seed", seed, 0)
    elif effective.seed is not None:
        problems.equal(f"{where}: seed", seed, effective.seed)
    else:
        problems.check(0 <= seed < 2**32, f"{where}: random seed {seed} is not 32-bit")


def _check_plausible(problems: Problems, where: str, prompt: Prompt, response: pb.GenerationResponse) -> None:
    problems.equal(f"{where}: input_token_count", response.input_token_count, len(prompt.ids))
    problems.check(
        1 <= response.generated_token_count <= prompt.max_new_tokens,
        f"{where}: {response.generated_token_count} tokens outside [1, {prompt.max_new_tokens}]",
    )
    problems.check(
        reason(response.stop_reason) in FINISHED_REASONS, f"{where}: stop reason {response.stop_reason}"
    )


def _check_stream_run(
    problems: Problems,
    r: Resolved,
    prompt: Prompt,
    messages: list[pb.GenerationResponse],
    unary_expected: Expected | None,
) -> None:
    effective = r.effective
    seed = 0 if effective.greedy else effective.seed
    shape = StreamShape(
        input_token_count=len(prompt.ids),
        echo=prompt.text if effective.input_text else "",
        seed=seed,
        input_tokens=effective.inputs is not None,
        generated_tokens=effective.generated is not None,
    )
    final = messages[-1] if messages else pb.GenerationResponse()
    expected = unary_expected
    deterministic = effective.greedy or effective.seed is not None
    if reason(final.stop_reason) == "TIME_LIMIT" or not deterministic:
        # Not reproducible: judge the stream by its own tokens, as the unary answer was.
        stream_final = pb.GenerationResponse(
            generated_token_count=final.generated_token_count,
            stop_reason=final.stop_reason,
            tokens=[t for m in messages for t in m.tokens],
        )
        expected = _expectation(problems, r, prompt, stream_final, "stream")
    check_stream(problems, messages, shape, expected)


# ---- claims: facts a case states about its own answer, so it keeps testing what it says ---------


def _claims_for(case: Case, index: int) -> dict[str, Any]:
    claims = {k: v for k, v in case.expect.items() if k not in ("per_input", *BATCH_CLAIMS)}
    per_input = case.expect.get("per_input") or []
    if index < len(per_input):
        claims.update(per_input[index] or {})
    return claims


BATCH_CLAIMS = ("distinct_seeds", "distinct_texts", "same_texts")


def _check_claims(
    problems: Problems,
    where: str,
    r: Resolved,
    prompt: Prompt,
    response: pb.GenerationResponse,
    expected: Expected | None,
    claims: dict[str, Any],
) -> None:
    outcome = expected.outcome if expected is not None else Outcome("", 0, "")
    generated_text = response.text[len(_echo(r, prompt)) :]
    facts = {
        "stop_reason": lambda: reason(response.stop_reason),
        "generated_token_count": lambda: response.generated_token_count,
        "input_token_count": lambda: response.input_token_count,
        "stop_sequence_index": lambda: outcome.stop_index,
        "matched": lambda: sorted(outcome.matched),
        "spans_tokens": lambda: outcome.spans_tokens,
        "ends_inside_token": lambda: outcome.ends_inside_token,
        "ignored_under_min": lambda: outcome.ignored_under_min,
        "multibyte_text": lambda: any(ord(ch) > 127 and ch != REPLACEMENT for ch in generated_text),
        "top_n_ties": lambda: (
            any(len(t.top_tokens) > r.effective.generated.top_n for t in response.tokens)
            if r.effective.generated
            else False
        ),
        "input_top_n_ties": lambda: (
            any(len(t.top_tokens) > r.effective.inputs.top_n for t in response.input_tokens)
            if r.effective.inputs
            else False
        ),
        "clamped": lambda: prompt.clamped,
        "virtual_input_tokens": lambda: len(response.input_tokens) - response.input_token_count,
        "changed_by_prefix": lambda: _changed_by_prefix(r, prompt),
        "logprobs": lambda: sorted({t.logprob for t in response.tokens}),
        "equals_greedy": lambda: _equals_greedy(r, prompt, response),
    }
    bounds = {
        "min_generated_token_count": lambda v: response.generated_token_count >= v,
        "max_generated_token_count": lambda v: response.generated_token_count <= v,
        "token_texts_include": lambda v: v in [t.text for t in response.tokens],
    }
    for key, value in claims.items():
        if key in bounds:
            problems.check(bounds[key](value), f"{where}: claim {key} {value!r} fails")
        elif key in facts:
            problems.equal(f"{where}: claim {key}", facts[key](), value)
        else:
            problems.append(f"{where}: unknown claim {key!r}")


def _equals_greedy(r: Resolved, prompt: Prompt, response: pb.GenerationResponse) -> bool:
    greedy = expected_greedy(r.ref, prompt, replace(r.effective, greedy=True))
    return (response.text, response.generated_token_count) == (greedy.text, greedy.generated_token_count)


def _changed_by_prefix(r: Resolved, prompt: Prompt) -> bool:
    """Whether the prefix steers greedy decoding at all, so that a server ignoring it would fail."""
    with_prefix = greedy_generation(r.ref, prompt, r.effective)[0]
    without = greedy_generation(r.ref, replace(prompt, prefix=None), r.effective)[0]
    return with_prefix != without


def _check_batch_claims(
    problems: Problems, expect: dict[str, Any], responses: Sequence[pb.GenerationResponse]
) -> None:
    seeds = [r.seed for r in responses]
    texts = [r.text for r in responses]
    if expect.get("distinct_seeds"):
        problems.equal("claim distinct_seeds", len(set(seeds)), len(seeds))
    if expect.get("distinct_texts"):
        problems.equal("claim distinct_texts", len(set(texts)), len(texts))
    if expect.get("same_texts"):
        problems.equal("claim same_texts", len(set(texts)), 1)


def test_concurrent_cases_shared_full_batches(
    suite_run: SuiteRun, suite_servers: dict[str, ServerThread]
) -> None:
    """The answers above were given by batches of several requests, up to MAX_BATCH_SIZE (8)."""
    for name in ("gpt2", "llama"):
        samples = suite_servers[name].metrics.registry.get_sample_value
        single = samples("tgi_batch_inference_batch_size_bucket", {"method": "next_token", "le": "1.0"})
        total = samples("tgi_batch_inference_batch_size_count", {"method": "next_token"})
        full = total - samples("tgi_batch_inference_batch_size_bucket", {"method": "next_token", "le": "7.0"})
        assert total and single is not None and single < total, f"{name}: every step ran a single request"
        assert full > 0, f"{name}: no step ran a full batch of 8"
