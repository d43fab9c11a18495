"""The model's tokenizer as the service uses it: encode, truncate (SPEC §7), byte offsets, raw tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Encoding:
    """Token ids of one text plus, when asked for, UTF-8 byte offsets of each token (specials: (0, 0))."""

    ids: tuple[int, ...]
    byte_offsets: tuple[tuple[int, int], ...] = ()


class Tokenizer:
    """Wraps a Hugging Face fast tokenizer; encode adds the tokenizer's special tokens unless told not to."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, *, skip_special_tokens: bool = True) -> None:
        self.hf = hf_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.adds_bos = self._adds_bos()

    @classmethod
    def load(
        cls, path: Path, *, trust_remote_code: bool = False, output_special_tokens: bool = False
    ) -> Tokenizer:
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        return cls(hf, skip_special_tokens=not output_special_tokens)

    def _adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        ids = self.hf("a")["input_ids"]
        return bool(ids) and ids[0] == self.bos_token_id

    def encode(self, text: str, *, with_offsets: bool = False, special_tokens: bool = True) -> Encoding:
        """`special_tokens=False` leaves out the tokenizer's BOS/EOS (a chat template already has them)."""
        encoded = self.hf(text, add_special_tokens=special_tokens, return_offsets_mapping=with_offsets)
        ids = tuple(encoded["input_ids"])
        if not with_offsets:
            return Encoding(ids)
        return Encoding(ids, _char_to_byte_offsets(text, encoded["offset_mapping"], ids, self.special_ids))

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.hf.all_special_ids)

    def truncate(self, ids: Sequence[int], keep_last: int) -> tuple[int, ...]:
        """Keep the last `keep_last` ids; a BOS-adding tokenizer's first kept id becomes BOS (SPEC §7)."""
        if keep_last <= 0 or keep_last >= len(ids):
            return tuple(ids)
        kept = list(ids[-keep_last:])
        if self.adds_bos and self.bos_token_id is not None:
            kept[0] = self.bos_token_id
        return tuple(kept)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary strings (`Ġfirst`, `<0x0A>`); an unknown id gives ""."""
        vocab_size = len(self.hf)
        return [str(self.hf.convert_ids_to_tokens(i)) if 0 <= i < vocab_size else "" for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.hf.decode(
                list(ids), skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
            )
        )


def _char_to_byte_offsets(
    text: str, char_offsets: Sequence[tuple[int, int]], ids: Sequence[int], special_ids: frozenset[int]
) -> tuple[tuple[int, int], ...]:
    """Turn character offsets into UTF-8 byte offsets, the unit TGIS clients rely on (SPEC §2.7)."""
    byte_at = [0, *itertools.accumulate(len(ch.encode("utf-8")) for ch in text)]
    return tuple(
        (0, 0) if token_id in special_ids else (byte_at[start], byte_at[end])
        for token_id, (start, end) in zip(ids, char_offsets, strict=True)
    )
