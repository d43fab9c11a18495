"""Comparisons of server answers with expectations: unary fields, token details, and the §4 stream rules."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import regex

from tests.conformance.expected import Expected
from tests.conformance.oracle import Token
from tgis.pb import generation_pb2 as pb

LOGPROB_TOLERANCE = 2e-3  # the server scores inside a padded batch, the reference alone
NOT_FINISHED = pb.StopReason.Name(pb.NOT_FINISHED)


class Problems(list[str]):
    """Every mismatch of one case, so a failure shows all of them at once."""

    def equal(self, what: str, actual: object, expected: object) -> None:
        if actual != expected:
            self.append(f"{what}: got {actual!r}, expected {expected!r}")

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.append(what)


def reason(value: int) -> str:
    return pb.StopReason.Name(value)


def close(actual: float, expected: float) -> bool:
    if math.isnan(expected) or math.isnan(actual):
        return math.isnan(expected) and math.isnan(actual)
    return abs(actual - expected) <= LOGPROB_TOLERANCE


def compare_tokens(
    problems: Problems, where: str, actual: Sequence[pb.TokenInfo], expected: Sequence[Token]
) -> None:
    problems.equal(f"{where}: number of tokens", len(actual), len(expected))
    for i, (got, want) in enumerate(zip(actual, expected, strict=False)):
        at = f"{where}[{i}]"
        problems.equal(f"{at}.text", got.text, want.text)
        problems.check(
            close(got.logprob, want.logprob), f"{at}.logprob: got {got.logprob}, expected {want.logprob}"
        )
        problems.equal(f"{at}.rank", got.rank, want.rank)
        problems.equal(f"{at}.top_tokens texts", [t.text for t in got.top_tokens], [t for t, _ in want.top])
        for j, (top, (_, logprob)) in enumerate(zip(got.top_tokens, want.top, strict=False)):
            problems.check(
                close(top.logprob, logprob), f"{at}.top_tokens[{j}].logprob: {top.logprob} != {logprob}"
            )


def compare_unary(
    problems: Problems, where: str, response: pb.GenerationResponse, expected: Expected, echo: str
) -> None:
    """Every unary field of SPEC §2.4 against the expectation; `echo` is the expected text prefix."""
    problems.equal(f"{where}: input_token_count", response.input_token_count, expected.input_token_count)
    problems.equal(
        f"{where}: generated_token_count", response.generated_token_count, expected.generated_token_count
    )
    problems.equal(f"{where}: text", response.text, echo + expected.text)
    problems.equal(f"{where}: stop_reason", reason(response.stop_reason), expected.stop_reason)
    problems.equal(f"{where}: stop_sequence", response.stop_sequence, expected.stop_sequence)
    compare_tokens(problems, f"{where}: tokens", response.tokens, expected.tokens or ())
    compare_tokens(problems, f"{where}: input_tokens", response.input_tokens, expected.input_tokens or ())


@dataclass(frozen=True)
class StreamShape:
    """What a stream of one request must look like besides its content."""

    input_token_count: int
    echo: str  # text of the first message (the input if input_text, never "\n\n")
    seed: int | None  # None: sampling without a seed, any 32-bit value repeated first and last
    input_tokens: bool
    generated_tokens: bool
    queued_out: bool = False  # deadline passed while queued: count 0, no text, TIME_LIMIT


def stream_parts(messages: Sequence[pb.GenerationResponse], shape: StreamShape) -> tuple[list, list]:
    """Split a stream after the first (and input-token) message: (head, token messages)."""
    head = 2 if shape.input_tokens and not shape.queued_out else 1
    return list(messages[:head]), list(messages[head:])


def check_stream(
    problems: Problems,
    messages: Sequence[pb.GenerationResponse],
    shape: StreamShape,
    expected: Expected | None,
) -> None:
    """SPEC §4: message sequence, suppression and final message; content as `expected` (None: unknown).

    Comparing stream and unary answers with the same expectation is the §4 parity check.
    """
    if len(messages) < 2:
        problems.append(f"stream: only {len(messages)} message(s)")
        return
    head, rest = stream_parts(messages, shape)
    first = head[0]
    problems.equal("stream first: input_token_count", first.input_token_count, shape.input_token_count)
    problems.equal("stream first: text", first.text, shape.echo)
    problems.equal("stream first: generated_token_count", first.generated_token_count, 0)
    problems.equal("stream first: stop_reason", reason(first.stop_reason), NOT_FINISHED)
    problems.check(not first.tokens and not first.input_tokens, "stream first: carries token info")
    if shape.seed is None:
        problems.check(0 <= first.seed < 2**32, f"stream first: seed {first.seed} not 32-bit")
    else:
        problems.equal("stream first: seed", first.seed, shape.seed)
    if len(head) == 2:
        _check_input_token_message(problems, head[1], expected)
    if not rest:
        problems.append("stream: no final message")
        return
    _check_token_messages(problems, rest, shape)
    final = rest[-1]
    problems.equal("stream final: seed", final.seed, first.seed)
    if expected is None:
        return
    problems.equal(
        "stream: generated_token_count", final.generated_token_count, expected.generated_token_count
    )
    problems.equal("stream: stop_reason", reason(final.stop_reason), expected.stop_reason)
    problems.equal("stream: stop_sequence", final.stop_sequence, expected.stop_sequence)
    problems.equal("stream: text", "".join(m.text for m in rest), expected.text)
    compare_tokens(problems, "stream: tokens", [t for m in rest for t in m.tokens], expected.tokens or ())


def _check_input_token_message(
    problems: Problems, message: pb.GenerationResponse, expected: Expected | None
) -> None:
    problems.check(bool(message.input_tokens), "stream: second message has no input_tokens")
    problems.equal(
        "stream input tokens: input_token_count", message.input_token_count, len(message.input_tokens)
    )
    problems.check(
        not message.text and message.generated_token_count == 0 and message.stop_reason == pb.NOT_FINISHED,
        "stream input tokens: message carries text, a count or a stop reason",
    )
    if expected is not None:
        compare_tokens(problems, "stream: input_tokens", message.input_tokens, expected.input_tokens or ())


def _check_token_messages(
    problems: Problems, rest: Sequence[pb.GenerationResponse], shape: StreamShape
) -> None:
    *progress, final = rest
    problems.check(final.stop_reason != pb.NOT_FINISHED, "stream: last message is not final")
    for i, m in enumerate(progress):
        at = f"stream progress[{i}]"
        problems.equal(f"{at}: stop_reason", reason(m.stop_reason), NOT_FINISHED)
        problems.check(
            m.input_token_count == 0 and not m.input_tokens and m.seed == 0,
            f"{at}: carries first-message fields",
        )
        problems.check(bool(m.text) or bool(m.tokens), f"{at}: empty progress message was not suppressed")
        problems.equal(f"{at}: stop_sequence", m.stop_sequence, "")
    problems.check(
        final.input_token_count == 0 and not final.input_tokens, "stream final: carries input fields"
    )
    counts = [m.generated_token_count for m in rest]
    problems.check(
        all(a < b for a, b in itertools.pairwise(counts)),
        f"stream: counts not increasing {counts}",
    )
    if shape.queued_out:
        problems.equal("stream queued out: final", (final.generated_token_count, final.text), (0, ""))
    elif shape.generated_tokens:
        problems.equal("stream: one token per message", [len(m.tokens) for m in rest], [1] * len(rest))
        problems.equal("stream: counts", counts, list(range(1, len(rest) + 1)))
    else:
        problems.check(counts[0] >= 1, "stream: first token message has count 0")
    _check_release_points(problems, rest)


def _check_release_points(problems: Problems, rest: Sequence[pb.GenerationResponse]) -> None:
    """While running, released text ends on grapheme boundaries of the final text (SPEC §5.1.3).

    No broken character is released either: the chunks concatenate to the reference decode of all
    tokens (checked with the text), so a U+FFFD released for an incomplete tail would show there.
    """
    final_text = "".join(m.text for m in rest)
    boundaries = {0} | {match.end() for match in regex.finditer(r"\X", final_text)}
    released = 0
    for i, m in enumerate(rest[:-1]):
        released += len(m.text)
        problems.check(
            released in boundaries, f"stream progress[{i}]: release splits a grapheme at {released}"
        )
