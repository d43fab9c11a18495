"""Incremental detokenization with prefix/read offsets: never releases a broken character (SPEC §5.2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

DecodeFn = Callable[[Sequence[int]], str]


class DecodingTokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the detokenizer needs."""

    def decode(
        self, token_ids: list[int], /, *, skip_special_tokens: bool, clean_up_tokenization_spaces: bool
    ) -> str | list[str]: ...


@dataclass
class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time (SPEC §5.2).

    `ids` starts with `context_ids` (decoder-only: the last few prompt ids, so the first generated
    token keeps its leading space; encoder-decoder: none). Text between `prefix_offset` and
    `read_offset` has been released; ids after `read_offset` are pending because their decoded text
    still ends in an incomplete UTF-8 sequence (U+FFFD) or adds nothing yet.
    """

    decode: DecodeFn
    context_ids: Sequence[int] = ()
    ids: list[int] = field(init=False)
    prefix_offset: int = field(init=False, default=0)
    read_offset: int = field(init=False)

    def __post_init__(self) -> None:
        self.ids = list(self.context_ids)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one id; return the newly decoded text, "" while the tail is pending."""
        self.ids.append(token_id)
        new = self._pending_text()
        if not new or new.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new

    def flush(self) -> str:
        """Release whatever is pending at the end, with trailing U+FFFD trimmed (SPEC §5.1.2)."""
        new = self._pending_text().rstrip(REPLACEMENT_CHAR)
        self.prefix_offset = self.read_offset = len(self.ids)
        return new

    @property
    def has_pending(self) -> bool:
        """Whether ids were added whose text has not been released yet."""
        return self.read_offset < len(self.ids)

    def _pending_text(self) -> str:
        released = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        # A shorter (or equal) decode means the new ids render nothing yet, e.g. a skipped special.
        return full[len(released) :] if len(full) > len(released) else ""


def tokenizer_decoder(tokenizer: DecodingTokenizer, *, skip_special_tokens: bool) -> DecodeFn:
    """Bind `tokenizer.decode` with the options every output path must share (SPEC §5.2)."""

    def decode(ids: Sequence[int]) -> str:
        text = tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        if not isinstance(text, str):
            raise TypeError(f"decode of one sequence returned {type(text).__name__}")
        return text

    return decode


def for_tokenizer(
    tokenizer: DecodingTokenizer,
    prompt_ids: Sequence[int],
    *,
    decoder_only: bool,
    skip_special_tokens: bool,
    context_size: int = 5,
) -> IncrementalDetokenizer:
    """Build a detokenizer for one request; decoder-only output continues the prompt (SPEC §5.1.1)."""
    context = list(prompt_ids[-context_size:]) if decoder_only and context_size > 0 else []
    decode = tokenizer_decoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return IncrementalDetokenizer(decode, context)
