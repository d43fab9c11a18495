"""What a conformance request should answer: effective parameters (SPEC §2.1) read from the request, and
the expected response per input, computed from the transformers reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tests.conformance.oracle import (
    Outcome,
    Penalties,
    Prefix,
    Reference,
    Token,
    Wanted,
    Warpers,
    apply_stop_rules,
    input_tokens,
    scored_token,
)
from tgis.pb import generation_pb2 as pb

MAX_SEQUENCE_LENGTH = 200
MAX_NEW_TOKENS = 169
DEFAULT_MAX_NEW_TOKENS = 20


@dataclass(frozen=True)
class Effective:
    """SPEC §2.1 read independently of the server's own conversion."""

    greedy: bool
    seed: int | None
    warpers: Warpers
    penalties: Penalties
    max_new_tokens: int
    stop_sequences: tuple[str, ...]
    include_stop_sequence: bool
    truncate: int
    input_text: bool
    generated: Wanted | None  # None unless generated_tokens
    inputs: Wanted | None  # None unless input_tokens

    @classmethod
    def of(cls, params: pb.Parameters | None) -> Effective:
        p = params if params is not None else pb.Parameters()
        sampling, stopping, response, decoding = p.sampling, p.stopping, p.response, p.decoding
        sample = p.method == pb.SAMPLE
        explicit_zero = sampling.HasField("temperature") and sampling.temperature == 0.0
        temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
        length = decoding.length_penalty if decoding.HasField("length_penalty") else None
        wanted = Wanted(response.token_logprobs, response.token_ranks, response.top_n_tokens)
        greedy = not sample or explicit_zero
        return cls(
            greedy=greedy,
            seed=sampling.seed if sample and sampling.HasField("seed") else None,
            warpers=Warpers(
                temperature=temperature if sample and temperature else 1.0,
                top_k=sampling.top_k if sample else 0,
                top_p=(sampling.top_p or 1.0) if sample else 1.0,
                typical_p=sampling.typical_p if sample else 0.0,
            ),
            penalties=Penalties(
                min_new_tokens=stopping.min_new_tokens,
                repetition_penalty=decoding.repetition_penalty or 1.0,
                length_penalty=None if length is None else (length.start_index, length.decay_factor),
            ),
            max_new_tokens=stopping.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            stop_sequences=tuple(stopping.stop_sequences),
            include_stop_sequence=stopping.include_stop_sequence
            if stopping.HasField("include_stop_sequence")
            else True,
            truncate=p.truncate_input_tokens,
            input_text=response.input_text,
            generated=wanted if response.generated_tokens else None,
            inputs=wanted if response.input_tokens else None,
        )


@dataclass(frozen=True)
class Prompt:
    """One input after tokenization and truncation, with its prompt-tuning prefix (SPEC §8) if any and
    its token budget (SPEC §3.1 clamp: the prefix length counts, truncation does not touch it)."""

    text: str
    ids: tuple[int, ...]
    max_new_tokens: int
    clamped: bool
    prefix: Prefix | None = None

    @classmethod
    def of(cls, ref: Reference, text: str, effective: Effective, prefix: Prefix | None = None) -> Prompt:
        ids = tuple(ref.truncate(ref.encode(text), effective.truncate))
        prefix_length = 0 if prefix is None else prefix.length(ref.encoder_decoder)
        room = MAX_SEQUENCE_LENGTH - len(ids) - prefix_length
        requested = effective.max_new_tokens
        return cls(text, ids, min(requested, room), requested > room, prefix)


@dataclass(frozen=True)
class Expected:
    """The unary answer for one input. `text` is the generated part only (no input echo)."""

    input_token_count: int
    generated_token_count: int
    text: str
    stop_reason: str
    stop_sequence: str
    tokens: tuple[Token, ...] | None  # None: not requested
    input_tokens: tuple[Token, ...] | None
    outcome: Outcome
    token_ids: tuple[int, ...]


def greedy_generation(ref: Reference, prompt: Prompt, effective: Effective) -> tuple[tuple[int, ...], list]:
    generated = ref.generate(prompt.ids, prompt.max_new_tokens, effective.penalties, prompt.prefix)
    return generated.token_ids, list(generated.scores)


def expected_greedy(ref: Reference, prompt: Prompt, effective: Effective) -> Expected:
    """Greedy decoding: transformers `generate()`, then SPEC §5 stop rules over its tokens."""
    token_ids, scores = greedy_generation(ref, prompt, effective)
    outcome = _stops(ref, prompt, effective, token_ids)
    if outcome is None:
        raise AssertionError(f"reference generation {token_ids} never stops")
    return _expected(ref, prompt, effective, token_ids, scores, outcome)


def expected_from_tokens(
    ref: Reference, prompt: Prompt, effective: Effective, token_ids: Sequence[int], time_limited: bool = False
) -> Expected:
    """Expected answer for tokens the server chose itself (sampling, time limits), judged by the reference.

    The scores are teacher-forced through the same processors and warpers; a sampled token the
    warpers filtered out is a failure the caller checks with `outside_support`.
    """
    scores = list(
        ref.forced_scores(prompt.ids, token_ids, effective.penalties, effective.warpers, prompt.prefix)
    )
    if time_limited:
        outcome = Outcome(ref.decode(token_ids).rstrip("\ufffd"), len(token_ids), "TIME_LIMIT")
    else:
        found = _stops(ref, prompt, effective, token_ids)
        outcome = found if found is not None else Outcome("<the stop rules do not stop here>", -1, "?")
    return _expected(ref, prompt, effective, tuple(token_ids), scores, outcome)


def outside_support(
    ref: Reference, prompt: Prompt, effective: Effective, token_ids: Sequence[int]
) -> list[int]:
    """Positions of tokens that the warped distribution gives probability 0."""
    scores = ref.forced_scores(prompt.ids, token_ids, effective.penalties, effective.warpers, prompt.prefix)
    return [j for j, t in enumerate(token_ids) if scores[j, t] == float("-inf")]


def _stops(ref: Reference, prompt: Prompt, effective: Effective, token_ids: Sequence[int]) -> Outcome | None:
    return apply_stop_rules(
        ref.decode,
        ref.eos_id,
        token_ids,
        max_new_tokens=prompt.max_new_tokens,
        clamped=prompt.clamped,
        min_new_tokens=effective.penalties.min_new_tokens,
        stop_sequences=effective.stop_sequences,
        include_stop_sequence=effective.include_stop_sequence,
    )


def _expected(
    ref: Reference,
    prompt: Prompt,
    effective: Effective,
    token_ids: Sequence[int],
    scores: list,
    outcome: Outcome,
) -> Expected:
    count = max(outcome.count, 0)
    tokens = None
    if effective.generated is not None:
        wanted = effective.generated
        tokens = tuple(scored_token(ref, scores[j], token_ids[j], wanted) for j in range(count))
    inputs = (
        None
        if effective.inputs is None
        else tuple(input_tokens(ref, prompt.ids, effective.inputs, prompt.prefix))
    )
    return Expected(
        input_token_count=len(prompt.ids),
        generated_token_count=outcome.count,
        text=outcome.text,
        stop_reason=outcome.stop_reason,
        stop_sequence=outcome.stop_sequence,
        tokens=tokens,
        input_tokens=inputs,
        outcome=outcome,
        token_ids=tuple(token_ids[:count]),
    )
