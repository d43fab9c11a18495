"""The benchmark workload: requests of seeded random prompt and output lengths, as exact token ids."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Plain words, so every tokenizer splits the filler text at the same places whichever way it is cut.
_WORD_LIST = """
    the of and to in is it that for as with was on be by at this from or have an they which one you
    were her all she there would their we him been has when who will more no if out so said what up
    its about into than them can only other new some could time these two may then do first any my
    now such like our over man me even most made after also did many before must through back years
    where much your way well down should because each just those people how too little state good
    very make world still own see men work long get here between both life being under never day
    same another know while last might us great old year off come since against go came right used
    take three small number large place found house light water point city play land home hand
"""
WORDS = tuple(_WORD_LIST.split())
FILLER_WORDS = 6000  # enough text for many distinct windows of the longest prompt
MAX_ATTEMPTS = 500


@dataclass(frozen=True)
class LengthRange:
    """An inclusive range of token counts, drawn uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """`16:128`, or `64` for a fixed length."""
        low, _, high = text.partition(":")
        return cls(int(low), int(high or low))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


@dataclass(frozen=True)
class WorkloadSpec:
    """What determines the requests: the same spec and tokenizer always give the same requests."""

    requests: int
    prompt_tokens: LengthRange  # with a shared prefix: the tokens after it (the question)
    new_tokens: LengthRange
    seed: int = 0
    shared_prefix_tokens: int = 0  # one prompt prefix every request starts with (a system prompt)
    long_prompt_every: int = 0  # every n-th request (the n-th, 2n-th...) brings a long prompt instead
    long_prompt_words: int = 400  # the long prompts' length in words of the filler text
    # Prompts are cut from this text's words instead of a seeded random filler (text the served model
    # knows: its continuations are what a speculator or an n-gram lookup can predict).
    prompt_text: str = ""
    prompt_source: str = ""  # where prompt_text came from, for the report (a file's name)
    # Input-grounded prompts: a window of the text, then the window's first fifth again. A model that
    # follows its input goes on copying the window, as outputs copy spans of the prompt in editing and
    # extraction (what prompt-lookup speculation predicts).
    grounded: bool = False

    def __post_init__(self) -> None:
        if self.long_prompt_every < 0 or self.long_prompt_words < 1:
            raise ValueError("long prompts need a positive period and word count")
        if self.long_prompt_every and self.shared_prefix_tokens:
            raise ValueError("a workload has either a shared prefix or long prompts, not both")
        if self.grounded and self.shared_prefix_tokens:
            raise ValueError("a workload has either a shared prefix or grounded prompts, not both")

    def is_long(self, index: int) -> bool:
        """Whether request `index` (from 0) is one of the long-prompt requests."""
        return bool(self.long_prompt_every) and (index + 1) % self.long_prompt_every == 0


@dataclass(frozen=True)
class BenchRequest:
    """One greedy request: the server tokenizes `text` to exactly `input_ids` (checked when built)."""

    index: int
    text: str
    input_ids: tuple[int, ...]
    max_new_tokens: int  # also its min_new_tokens, so an early EOS never shortens it


def build_workload(tokenizer: PreTrainedTokenizerBase, spec: WorkloadSpec) -> list[BenchRequest]:
    """Prompts are windows of a seeded filler text whose decode → encode round trip is exact; with long
    prompts, every n-th request's prompt is a window of the filler's words instead (the other requests
    stay exactly what they are without long prompts)."""
    rng = random.Random(spec.seed)
    words = _filler_words(spec, rng)
    requests = _short_requests(tokenizer, spec, words, rng)
    long_rng = random.Random(f"{spec.seed}-long")  # its own stream: the short requests stay as they are
    for index in range(len(requests)):
        if spec.is_long(index):
            text = " " + " ".join(_word_window(words, spec.long_prompt_words, long_rng))
            ids = tuple(_encode(tokenizer, text, specials=True))
            requests[index] = dataclasses.replace(requests[index], text=text, input_ids=ids)
    return requests


def fresh_prompts(
    tokenizer: PreTrainedTokenizerBase, spec: WorkloadSpec, requests: Sequence[BenchRequest], variant: str
) -> list[BenchRequest]:
    """`requests` (of `build_workload(tokenizer, spec)`) with prompts drawn anew from the same text by the
    seeded stream `variant`: the same indices, prompt lengths (in tokens; a long prompt's in words, as
    the spec gives it) and token budgets, so as much work, but none of it found in a prefix cache
    that `requests` filled. A shared prefix stays shared: it is the prefix a cache is meant to keep."""
    rng = random.Random(spec.seed)
    words = _filler_words(spec, rng)
    source, added, prefix = _prompt_material(tokenizer, spec, words, rng)  # as build_workload draws them
    variant_rng = random.Random(f"{spec.seed}-{variant}")
    fresh = []
    for request in requests:
        if spec.is_long(request.index):
            text = " " + " ".join(_word_window(words, spec.long_prompt_words, variant_rng))
            ids = tuple(_encode(tokenizer, text, specials=True))
        elif spec.shared_prefix_tokens:
            length = len(request.input_ids) - spec.shared_prefix_tokens
            text, ids = _continuation(tokenizer, source, prefix, length, variant_rng)
        else:
            text, ids = _prompt(
                tokenizer, source, len(request.input_ids), added, variant_rng, grounded=spec.grounded
            )
        fresh.append(dataclasses.replace(request, text=text, input_ids=ids))
    return fresh


def _filler_words(spec: WorkloadSpec, rng: random.Random) -> list[str]:
    """The text prompts are cut from: `spec.prompt_text`, or a filler of random words drawn from `rng`
    (drawn either way, so that `rng` goes on from the same state)."""
    words = [rng.choice(WORDS) for _ in range(FILLER_WORDS)]
    return spec.prompt_text.split() if spec.prompt_text else words


def _word_window(words: Sequence[str], length: int, rng: random.Random) -> Sequence[str]:
    if length > len(words):
        raise ValueError(f"long prompts of {length} words exceed the {len(words)}-word filler text")
    start = rng.randrange(len(words) - length + 1)
    return words[start : start + length]


def _prompt_material(
    tokenizer: PreTrainedTokenizerBase, spec: WorkloadSpec, words: Sequence[str], rng: random.Random
) -> tuple[list[int], int, tuple[str, tuple[int, ...]]]:
    """The ids prompts are cut from, how many special tokens the tokenizer adds to a prompt, and the
    shared prefix (text and ids; empty without one), drawn first from `rng`."""
    source = _encode(tokenizer, " " + " ".join(words), specials=False)
    added = len(_encode(tokenizer, "the", specials=True)) - len(_encode(tokenizer, "the", specials=False))
    shared: tuple[str, tuple[int, ...]] = ("", ())
    if spec.shared_prefix_tokens:
        shared = _prompt(tokenizer, source, spec.shared_prefix_tokens, added, rng)
    return source, added, shared


def _short_requests(
    tokenizer: PreTrainedTokenizerBase, spec: WorkloadSpec, words: Sequence[str], rng: random.Random
) -> list[BenchRequest]:
    source, added, shared = _prompt_material(tokenizer, spec, words, rng)
    requests = []
    for index in range(spec.requests):
        length = spec.prompt_tokens.draw(rng)
        if spec.shared_prefix_tokens:
            text, ids = _continuation(tokenizer, source, shared, length, rng)
        else:
            text, ids = _prompt(tokenizer, source, length, added, rng, grounded=spec.grounded)
        requests.append(BenchRequest(index, text, ids, spec.new_tokens.draw(rng)))
    return requests


def _continuation(
    tokenizer: PreTrainedTokenizerBase,
    source: Sequence[int],
    prefix: tuple[str, tuple[int, ...]],
    length: int,
    rng: random.Random,
) -> tuple[str, tuple[int, ...]]:
    """The shared prefix then a `length`-token window, tokenized to exactly the prefix ids then its own."""
    prefix_text, prefix_ids = prefix
    for _ in range(MAX_ATTEMPTS):
        start = rng.randrange(len(source) - length)
        window = tuple(source[start : start + length])
        question = tokenizer.decode(
            list(window), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        assert isinstance(question, str)  # one sequence in, one string out
        text = prefix_text + question
        if tuple(_encode(tokenizer, text, specials=True)) == prefix_ids + window:
            return text, prefix_ids + window
    raise ValueError(
        f"no {length}-token window continues the shared prefix through a decode/encode round trip"
    )


def _prompt(
    tokenizer: PreTrainedTokenizerBase,
    source: Sequence[int],
    length: int,
    added: int,
    rng: random.Random,
    *,
    grounded: bool = False,
) -> tuple[str, tuple[int, ...]]:
    body = length - added
    repeated = body // 5 if grounded else 0  # the window's first tokens, again at its end
    if body - repeated < 1 or body >= len(source):
        raise ValueError(f"cannot build a {length}-token prompt with this tokenizer")
    for _ in range(MAX_ATTEMPTS):
        start = rng.randrange(len(source) - body)
        window = list(source[start : start + body - repeated])
        window += window[:repeated]
        text = tokenizer.decode(list(window), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)  # one sequence in, one string out
        if _encode(tokenizer, text, specials=False) == window:
            ids = tuple(_encode(tokenizer, text, specials=True))
            if len(ids) == length:
                return text, ids
    raise ValueError(f"no {length}-token window of the filler text survives a decode/encode round trip")


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, *, specials: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=specials, verbose=False)["input_ids"])


WARMUP_NEW_TOKENS = 4  # each warmup request's budget: it only has to reach the decode step


@dataclass(frozen=True)
class Sweep:
    """What a benchmark sends a server (tgis, or a peer after it): the untimed warmup requests, then
    each concurrency level's requests. The first level sends the workload's requests, every later level
    and the warmup prompts of their own (`fresh_prompts`: the same lengths and budgets), so that no
    level is timed on prompts a prefix cache kept from the warmup or an earlier level; a prefix
    cache is on by default in tgis, vLLM and llama.cpp's server alike."""

    warmup: tuple[BenchRequest, ...]
    levels: tuple[tuple[int, tuple[BenchRequest, ...]], ...]  # (concurrency, the requests it sends)

    @property
    def timed(self) -> list[BenchRequest]:
        """Every level's requests, in order."""
        return [request for _, sent in self.levels for request in sent]


def build_sweep(
    tokenizer: PreTrainedTokenizerBase,
    spec: WorkloadSpec,
    requests: Sequence[BenchRequest],
    concurrency: Sequence[int],
    *,
    warmup: int,
    per_client: int | None = None,
) -> Sweep:
    """The sweep over `concurrency` of the workload `requests` (`build_workload(tokenizer, spec)`), with
    `warmup` short requests first and, with `per_client`, `level_requests`' share at each level."""
    warmup_requests = [
        dataclasses.replace(request, max_new_tokens=min(request.max_new_tokens, WARMUP_NEW_TOKENS))
        for request in fresh_prompts(tokenizer, spec, requests[:warmup], "warmup")
    ]
    levels = []
    for number, size in enumerate(concurrency):
        chosen = level_requests(requests, size, per_client)
        if number:
            chosen = fresh_prompts(tokenizer, spec, chosen, f"level-{number}")
        levels.append((size, tuple(chosen)))
    return Sweep(tuple(warmup_requests), tuple(levels))


def level_requests(requests: Sequence[BenchRequest], size: int, per_client: int | None) -> list[BenchRequest]:
    """The requests a level of `size` concurrent clients (or a baseline at batch `size`) sends: all of
    them, or with `per_client` the first `per_client × size` (so every level runs the same number of
    rounds, and the lowest levels do not take the longest)."""
    if per_client is None:
        return list(requests)
    return list(requests[: per_client * size])


def fingerprint(requests: Sequence[BenchRequest]) -> str:
    """A short hash of every request's ids and token budget, to tell whether two runs saw the same work."""
    digest = hashlib.sha256()
    for request in requests:
        digest.update(repr((request.input_ids, request.max_new_tokens)).encode())
    return digest.hexdigest()[:16]
