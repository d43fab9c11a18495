"""Per-request stopping: stop-reason precedence, stop sequences across tokens, streaming release (SPEC §5)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import regex

from tgis.types import StoppingParams, StopReason, TokenEvent

_GRAPHEME = regex.compile(r"\X")


class TextSource(Protocol):
    """An incremental detokenizer: text per added token, then whatever was pending (SPEC §5.2)."""

    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class StopCriteria:
    """The rules that end one request (SPEC §5.3, §5.5, §5.6)."""

    max_new_tokens: int
    min_new_tokens: int = 0
    max_tokens_clamped: bool = False
    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    deadline: float | None = None

    def __post_init__(self) -> None:
        if any(not s for s in self.stop_sequences):
            raise ValueError("stop sequences must be non-empty")

    @classmethod
    def from_params(
        cls,
        params: StoppingParams,
        *,
        eos_token_ids: frozenset[int],
        arrival_time: float,
        max_new_tokens: int | None = None,
    ) -> StopCriteria:
        """Criteria of one input; `max_new_tokens` below the requested one marks a clamp (SPEC §3.1). The
        request's own stop ids end it as the model's EOS ids do: EOS_TOKEN, counted, no text."""
        limit = params.max_new_tokens if max_new_tokens is None else max_new_tokens
        millis = params.time_limit_millis
        return cls(
            max_new_tokens=limit,
            min_new_tokens=params.min_new_tokens,
            max_tokens_clamped=limit < params.max_new_tokens,
            stop_sequences=params.stop_sequences,
            include_stop_sequence=params.include_stop_sequence,
            eos_token_ids=eos_token_ids | frozenset(params.stop_token_ids),
            deadline=arrival_time + millis / 1000 if millis > 0 else None,
        )

    @property
    def hold_back_bytes(self) -> int:
        """H of SPEC §5.4: bytes of output that must stay unreleased behind the newest token boundary."""
        if not self.stop_sequences:
            return 0
        if self.include_stop_sequence:
            return 1
        return max(len(s.encode("utf-8")) for s in self.stop_sequences)


@dataclass(frozen=True)
class _Boundary:
    """Where a token's text ends in the output, in characters and in UTF-8 bytes."""

    chars: int
    bytes: int


@dataclass
class OutputTracker:
    """Generated text of one request: decides when it stops and which text may be released.

    Every emitted `TokenEvent.text` is final: the deltas of a request, concatenated, are its unary
    text. Release never passes a point a later stop-sequence trim could cut (see `_release_limit`).
    """

    criteria: StopCriteria
    source: TextSource
    clock: Callable[[], float] = time.monotonic
    generated_tokens: int = field(init=False, default=0)
    stop_reason: StopReason = field(init=False, default=StopReason.NOT_FINISHED)
    stop_sequence: str | None = field(init=False, default=None)
    _output: str = field(init=False, default="")
    _output_bytes: int = field(init=False, default=0)
    _released: int = field(init=False, default=0)
    _boundaries: list[_Boundary] = field(init=False, default_factory=list)

    @property
    def finished(self) -> bool:
        return self.stop_reason != StopReason.NOT_FINISHED

    @property
    def released_text(self) -> str:
        """Everything released so far; once finished, the unary `text`."""
        return self._output[: self._released]

    def on_token(self, token_id: int) -> TokenEvent:
        """Account one generated token and apply the precedence of SPEC §5.6."""
        if self.finished:
            raise RuntimeError(f"request already stopped with {self.stop_reason.name}")
        self.generated_tokens += 1
        is_eos = token_id in self.criteria.eos_token_ids
        if self._deadline_passed():
            # A trailing EOS is never rendered (SPEC §5.1.4), whatever ended the request.
            self._append("" if is_eos else self.source.add(token_id))
            return self._finish(StopReason.TIME_LIMIT)
        if self.generated_tokens < self.criteria.min_new_tokens:
            self._append(self.source.add(token_id))
            return self._progress()
        if is_eos:
            return self._finish(StopReason.EOS_TOKEN)
        added = self._append(self.source.add(token_id))
        if self.generated_tokens >= self.criteria.max_new_tokens:
            return self._finish(self._limit_reason())
        return self._check_stop_sequences(added)

    def finish_now(self, reason: StopReason) -> TokenEvent:
        """Stop from outside (cancel, error, deadline passed while queued); release what remains."""
        if self.finished:
            raise RuntimeError(f"request already stopped with {self.stop_reason.name}")
        return self._finish(reason)

    def _deadline_passed(self) -> bool:
        deadline = self.criteria.deadline
        return deadline is not None and self.clock() >= deadline

    def _limit_reason(self) -> StopReason:
        return StopReason.TOKEN_LIMIT if self.criteria.max_tokens_clamped else StopReason.MAX_TOKENS

    def _append(self, text: str) -> int:
        """Add a token's text to the output; return how many characters it added."""
        self._output += text
        self._output_bytes += len(text.encode("utf-8"))
        self._boundaries.append(_Boundary(len(self._output), self._output_bytes))
        return len(text)

    def _check_stop_sequences(self, added: int) -> TokenEvent:
        if added == 0:
            return self._progress()
        for seq in self.criteria.stop_sequences:
            pos = _rightmost_new_occurrence(self._output, seq, added)
            if pos is not None:
                cut = pos + len(seq) if self.criteria.include_stop_sequence else pos
                return self._stop_at(seq, cut)
        return self._progress()

    def _stop_at(self, seq: str, cut: int) -> TokenEvent:
        if cut < self._released:
            raise AssertionError("stop-sequence trim would retract released text")
        # Pending detokenizer ids all lie beyond the cut, so nothing is flushed.
        self._output = self._output[:cut]
        self.stop_sequence = seq
        return self._end(StopReason.STOP_SEQUENCE)

    def _finish(self, reason: StopReason) -> TokenEvent:
        self._output += self.source.flush()
        return self._end(reason)

    def _end(self, reason: StopReason) -> TokenEvent:
        self.stop_reason = reason
        return self._release(len(self._output))

    def _progress(self) -> TokenEvent:
        return self._release(self._release_limit())

    def _release(self, upto: int) -> TokenEvent:
        text = self._output[self._released : upto]
        self._released = upto
        self._boundaries = [b for b in self._boundaries if b.chars > upto]
        return TokenEvent(self.generated_tokens, text, None, self.stop_reason, self.stop_sequence)

    def _release_limit(self) -> int:
        """Furthest character index that may be released now (SPEC §5.4, §5.1.3).

        A later stop match must include a byte added after this token, so it starts at most
        len(seq) - 1 bytes before the current end; the cut is at its start (exclude) or end (include).
        Staying at a token boundary at least H bytes before the end therefore keeps every future cut
        at or after the release point. Within that, release stops at a grapheme-cluster start and
        keeps the last cluster, which later text could still extend.
        """
        return self._grapheme_floor(self._token_limit())

    def _token_limit(self) -> int:
        hold = self.criteria.hold_back_bytes
        if hold == 0:
            return len(self._output)
        for boundary in reversed(self._boundaries):
            if self._output_bytes - boundary.bytes >= hold:
                return boundary.chars
        return self._released

    def _grapheme_floor(self, limit: int) -> int:
        """The last grapheme-cluster start at or before `limit`, never the end of the output."""
        best = self._released
        for cluster in _GRAPHEME.finditer(self._output, self._released):
            if cluster.start() > limit:
                break
            best = cluster.start()
        return best


def _rightmost_new_occurrence(output: str, seq: str, added: int) -> int | None:
    """Start of the rightmost `seq` in `output` that overlaps its last `added` characters (SPEC §5.3).

    Matching characters is matching UTF-8 bytes: a valid sequence can only match at character
    boundaries, and byte and character positions order the same way.
    """
    start = max(0, len(output) - added - len(seq) + 1)
    pos = output.rfind(seq, start)
    return pos if pos >= 0 else None
