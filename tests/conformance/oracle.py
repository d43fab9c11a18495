"""Ground truth for conformance cases: transformers on the same tiny model, SPEC §2.5/§5 written plainly.

Nothing here imports `tgis`: generated tokens come from transformers' `generate()` with its own logits
processors, input-token scores from one forward pass, and token details, detokenization and stop rules
from the SPEC's wording, brute force. With a prompt-tuning prefix (SPEC §8) `generate()` cannot keep the
prompt as the penalties' context, so the same processors run over full forward passes of the embeddings
with the prefix prepended, one pass per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    LogitsProcessorList,
)
from transformers.generation.logits_process import (
    ExponentialDecayLengthPenalty,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

REPLACEMENT = "\ufffd"
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Penalties:
    """SPEC §2.2 steps 1–3, applied to greedy and sampling alike."""

    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    length_penalty: tuple[int, float] | None = None  # (start_index, decay_factor)


@dataclass(frozen=True)
class Warpers:
    """SPEC §2.2 step 4, effective values (§2.1): 1.0 / 0 mean disabled."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 0.0


@dataclass(frozen=True)
class Wanted:
    """Which token details a request asked for."""

    logprobs: bool = False
    ranks: bool = False
    top_n: int = 0


@dataclass(frozen=True)
class Token:
    """An expected TokenInfo: raw vocabulary text plus requested scores."""

    text: str
    logprob: float = 0.0
    rank: int = 0
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Prefix:
    """Prompt-tuning embeddings of one store entry (SPEC §8), as the reference prepends them.

    Equal and hashed by id only, so it can key the reference's caches."""

    prefix_id: str
    decoder: torch.Tensor | None = field(default=None, compare=False)  # [n, hidden]
    encoder: torch.Tensor | None = field(default=None, compare=False)  # [m, hidden], encoder-decoder only

    def length(self, encoder_decoder: bool) -> int:
        """P of SPEC §8: decoder rows; encoder-decoder: encoder rows, plus decoder rows + 1 if any."""
        decoder = _rows(self.decoder)
        if not encoder_decoder:
            return decoder
        return _rows(self.encoder) + (decoder + 1 if self.decoder is not None else 0)

    def virtual_inputs(self, encoder_decoder: bool) -> int:
        """Virtual positions in front of the input: the encoder prefix of an encoder-decoder model."""
        return _rows(self.encoder if encoder_decoder else self.decoder)


def _rows(embeddings: torch.Tensor | None) -> int:
    return 0 if embeddings is None else int(embeddings.shape[0])


def _prepend(prefix: torch.Tensor | None, embeddings: torch.Tensor) -> torch.Tensor:
    return embeddings if prefix is None else torch.cat([prefix.to(embeddings.dtype), embeddings])


@dataclass(frozen=True)
class Generated:
    token_ids: tuple[int, ...]
    scores: torch.Tensor  # [n, V] final processed scores of each step


@dataclass(frozen=True)
class Outcome:
    """How a token sequence ends under SPEC §5.3/§5.6, with facts the cases make claims about."""

    text: str
    count: int
    stop_reason: str
    stop_sequence: str = ""
    stop_index: int | None = None
    matched: tuple[int, ...] = ()  # stop sequences matching at the last token, even if MAX won
    spans_tokens: bool = False
    ends_inside_token: bool = False
    ignored_under_min: bool = False  # a stop occurrence completed within the first min_new_tokens


@dataclass
class Reference:
    """One tiny model and its tokenizer as any transformers user would load them."""

    path: Path
    model: Any
    tokenizer: Any
    encoder_decoder: bool
    eos_id: int
    pad_id: int
    adds_bos: bool
    _generated: dict[tuple[Any, ...], Generated] = field(default_factory=dict)
    _prompt_logits: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> Reference:
        config = AutoConfig.from_pretrained(path)
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        bos = tokenizer.bos_token_id
        probe = tokenizer("a")["input_ids"]
        return cls(
            path=path,
            model=model,
            tokenizer=tokenizer,
            encoder_decoder=bool(config.is_encoder_decoder),
            eos_id=int(config.eos_token_id),
            pad_id=int(config.pad_token_id),
            adds_bos=bos is not None and bool(probe) and probe[0] == bos,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    # ---- tokenizer -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def truncate(self, ids: Sequence[int], keep_last: int) -> list[int]:
        """SPEC §7: keep the last N ids; a BOS-adding tokenizer's first kept id becomes BOS."""
        if keep_last <= 0 or keep_last >= len(ids):
            return list(ids)
        kept = list(ids[-keep_last:])
        if self.adds_bos:
            kept[0] = self.tokenizer.bos_token_id
        return kept

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )

    def raw(self, ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(ids))]

    def token_id(self, raw: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(raw))

    # ---- model ---------------------------------------------------------------------------------

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, penalties: Penalties, prefix: Prefix | None = None
    ) -> Generated:
        """Greedy `generate()` with the SPEC's penalties as transformers logits processors, in SPEC order."""
        key = (tuple(prompt), max_new_tokens, penalties, prefix)
        if key not in self._generated:
            if prefix is None:
                self._generated[key] = self._generate(list(prompt), max_new_tokens, penalties)
            else:
                self._generated[key] = self._generate_with_prefix(
                    list(prompt), max_new_tokens, penalties, prefix
                )
        return self._generated[key]

    def _generate(self, prompt: list[int], max_new_tokens: int, penalties: Penalties) -> Generated:
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                logits_processor=self._penalty_processors(len(prompt), penalties),
                output_scores=True,
                return_dict_in_generate=True,
                eos_token_id=self.eos_id,
                pad_token_id=self.pad_id,
            )
        sequence = out.sequences[0]
        new = sequence[1:] if self.encoder_decoder else sequence[len(prompt) :]
        return Generated(tuple(new.tolist()), torch.cat(out.scores).float())

    def _generate_with_prefix(
        self, prompt: list[int], max_new_tokens: int, penalties: Penalties, prefix: Prefix
    ) -> Generated:
        """Greedy decoding as `generate()` does it, each step one forward pass over the prefixed embeddings.

        The processors see the same ids as under `generate()`: prompt + generated (decoder-only) or
        decoder start + generated, never the virtual positions."""
        chain = self._penalty_processors(len(prompt), penalties)
        context = self._context(prompt)
        tokens: list[int] = []
        scores: list[torch.Tensor] = []
        while len(tokens) < max_new_tokens:
            logits = self._prefixed_logits(prompt, tokens, prefix)[-1:]
            row = chain(_ids([*context, *tokens]), logits.clone())
            token = int(row[0].argmax())  # the first maximum: ties go to the lowest id
            tokens.append(token)
            scores.append(row)
            if token == self.eos_id:
                break
        return Generated(tuple(tokens), torch.cat(scores))

    def _context(self, prompt: Sequence[int]) -> list[int]:
        """The ids the processors see before the first generated token."""
        if self.encoder_decoder:
            return [int(self.model.config.decoder_start_token_id)]
        return list(prompt)

    def _prefixed_logits(self, prompt: Sequence[int], tokens: Sequence[int], prefix: Prefix) -> torch.Tensor:
        """Raw logits [len(tokens) + 1, V] predicting each token after `tokens[:t]`, the prefix prepended:
        decoder-only [prefix, prompt, tokens]; encoder-decoder encoder [encoder prefix, prompt] and
        decoder [decoder prefix, start, tokens] (SPEC §8 "Use")."""
        embed = self.model.get_input_embeddings()
        with torch.inference_mode():
            if self.encoder_decoder:
                source = _prepend(prefix.encoder, embed(torch.tensor(list(prompt))))
                encoded = self.model.get_encoder()(inputs_embeds=source[None]).last_hidden_state
                target = _prepend(prefix.decoder, embed(torch.tensor(self._context(prompt) + list(tokens))))
                logits = self.model(encoder_outputs=(encoded,), decoder_inputs_embeds=target[None]).logits[0]
                first = _rows(prefix.decoder)
            else:
                target = _prepend(prefix.decoder, embed(torch.tensor([*prompt, *tokens])))
                logits = self.model(inputs_embeds=target[None]).logits[0]
                first = _rows(prefix.decoder) + len(prompt) - 1
        return logits[first:].float()

    def forced_scores(
        self,
        prompt: Sequence[int],
        tokens: Sequence[int],
        penalties: Penalties,
        warpers: Warpers,
        prefix: Prefix | None = None,
    ) -> torch.Tensor:
        """Final scores [n, V] of each step with `tokens` teacher-forced (to judge sampled tokens)."""
        if not tokens:
            return torch.zeros(0, self.vocab_size)
        history = [*self._context(prompt), *tokens]
        offset = len(history) - len(tokens)
        if prefix is not None:
            logits = self._prefixed_logits(prompt, tokens[:-1], prefix)
        else:
            with torch.inference_mode():
                if self.encoder_decoder:
                    logits = self.model(
                        input_ids=torch.tensor([list(prompt)]), decoder_input_ids=torch.tensor([history[:-1]])
                    ).logits[0]
                else:
                    logits = self.model(input_ids=torch.tensor([history[:-1]])).logits[0, len(prompt) - 1 :]
        chain = LogitsProcessorList(
            [*self._penalty_processors(len(prompt), penalties), *_warper_list(warpers, self.vocab_size)]
        )
        rows = [
            chain(_ids(history[: offset + t]), logits[t : t + 1].float().clone()) for t in range(len(tokens))
        ]
        return torch.cat(rows)

    def prompt_logits(self, prompt: Sequence[int], prefix: Prefix | None = None) -> torch.Tensor:
        """Raw logits [P + L, V] of one forward pass over a decoder-only prompt, prefix embeddings first."""
        key = (tuple(prompt), prefix)
        if key not in self._prompt_logits:
            with torch.inference_mode():
                if prefix is None:
                    logits = self.model(input_ids=torch.tensor([list(prompt)])).logits[0]
                else:
                    embeddings = self.model.get_input_embeddings()(torch.tensor(list(prompt)))
                    logits = self.model(inputs_embeds=_prepend(prefix.decoder, embeddings)[None]).logits[0]
                self._prompt_logits[key] = logits.float()
        return self._prompt_logits[key]

    def _penalty_processors(self, prompt_length: int, penalties: Penalties) -> LogitsProcessorList:
        # The decoder of an encoder-decoder model starts from one decoder-start token, which is
        # neither prompt nor output: it does not count for min tokens, length or repetition.
        skip = 1 if self.encoder_decoder else prompt_length
        chain = LogitsProcessorList()
        if penalties.min_new_tokens > 0:
            chain.append(MinNewTokensLengthLogitsProcessor(skip, penalties.min_new_tokens, self.eos_id))
        if penalties.length_penalty is not None and penalties.length_penalty[1] != 1.0:
            chain.append(ExponentialDecayLengthPenalty(penalties.length_penalty, self.eos_id, skip))
        if penalties.repetition_penalty != 1.0:
            ignore = 1 if self.encoder_decoder else None
            chain.append(
                RepetitionPenaltyLogitsProcessor(penalties.repetition_penalty, prompt_ignore_length=ignore)
            )
        return chain


def _ids(ids: Sequence[int]) -> torch.LongTensor:
    return cast(torch.LongTensor, torch.tensor([list(ids)], dtype=torch.long))


def _warper_list(warpers: Warpers, vocab_size: int) -> LogitsProcessorList:
    chain = LogitsProcessorList()
    if warpers.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(warpers.temperature))
    if 0 < warpers.top_k < vocab_size:
        chain.append(TopKLogitsWarper(warpers.top_k))
    if 0 < warpers.top_p < 1:
        chain.append(TopPLogitsWarper(warpers.top_p))
    if 0 < warpers.typical_p < 1:
        chain.append(TypicalLogitsWarper(warpers.typical_p))
    return chain


# ---- token details (SPEC §2.5) ------------------------------------------------------------------


def scored_token(ref: Reference, scores: torch.Tensor, token_id: int, wanted: Wanted) -> Token:
    """Details of `token_id` under one row of final scores: logprob, rank and top-n as §2.5 words them."""
    logprobs = torch.log_softmax(scores.float(), dim=-1).tolist()
    chosen = logprobs[token_id]
    rank = 1 + sum(1 for lp in logprobs if lp > chosen)
    top = _top_n(logprobs, wanted.top_n, wanted.logprobs) if wanted.top_n else []
    return Token(
        text=ref.raw([token_id])[0],
        logprob=chosen if wanted.logprobs else 0.0,
        rank=rank if wanted.ranks else 0,
        top=tuple(zip(ref.raw([i for i, _ in top]), [lp for _, lp in top], strict=True)),
    )


def _top_n(logprobs: list[float], top_n: int, with_logprobs: bool) -> list[tuple[int, float]]:
    """Every finite token scoring >= the n-th highest, at most 4n, lowest ids first among ties."""
    n = min(top_n, len(logprobs))
    order = sorted(range(len(logprobs)), key=lambda i: (-logprobs[i], i))
    nth = logprobs[order[n - 1]]
    chosen = [i for i in order if logprobs[i] >= nth and logprobs[i] > NEG_INF][: 4 * n]
    if with_logprobs:
        return [(i, logprobs[i]) for i in chosen]
    return [(i, 0.0) for i in sorted(chosen)]


def input_tokens(
    ref: Reference, prompt: Sequence[int], wanted: Wanted, prefix: Prefix | None = None
) -> list[Token]:
    """Input-token details: raw logits for decoder-only (entry 0 NaN), text and NaN for encoder-decoder.

    A prefix's virtual positions come first as pad tokens (SPEC §2.5, §15 #7), scored like the rest
    over the prefixed embeddings: each entry i ≥ 1 under the logits of position i − 1."""
    virtual = 0 if prefix is None else prefix.virtual_inputs(ref.encoder_decoder)
    ids = [ref.pad_id] * virtual + list(prompt)
    texts = ref.raw(ids)
    first_logprob = math.nan if wanted.logprobs else 0.0
    if ref.encoder_decoder:
        return [Token(text, logprob=first_logprob) for text in texts]
    logits = ref.prompt_logits(prompt, prefix)
    tokens = [Token(texts[0], logprob=first_logprob)]
    tokens += [scored_token(ref, logits[i - 1], ids[i], wanted) for i in range(1, len(ids))]
    return tokens


# ---- detokenization and stop rules (SPEC §5) ----------------------------------------------------


Decode = Callable[[Sequence[int]], str]


def released_outputs(decode: Decode, token_ids: Sequence[int]) -> list[str]:
    """Output text after each token: the decode of all tokens so far, unless it ends in a broken character."""
    outputs: list[str] = []
    previous = ""
    for n in range(1, len(token_ids) + 1):
        text = decode(token_ids[:n])
        previous = previous if text.endswith(REPLACEMENT) else text
        outputs.append(previous)
    return outputs


def apply_stop_rules(
    decode: Decode,
    eos_id: int,
    token_ids: Sequence[int],
    *,
    max_new_tokens: int,
    clamped: bool = False,
    min_new_tokens: int = 0,
    stop_sequences: Sequence[str] = (),
    include_stop_sequence: bool = True,
) -> Outcome | None:
    """SPEC §5.6 precedence (no deadline) and §5.3 matching over UTF-8 bytes; None if nothing stops."""
    outputs = released_outputs(decode, token_ids)
    ignored = False
    for n, token in enumerate(token_ids, start=1):
        before = outputs[n - 2] if n > 1 else ""
        matches = _matches(outputs[n - 1], before, stop_sequences)
        if n < min_new_tokens:
            ignored = ignored or bool(matches)
            continue
        if token == eos_id:
            return Outcome(_final(decode, token_ids[: n - 1]), n, "EOS_TOKEN", ignored_under_min=ignored)
        if n >= max_new_tokens:
            reason = "TOKEN_LIMIT" if clamped else "MAX_TOKENS"
            return Outcome(
                _final(decode, token_ids[:n]), n, reason, matched=tuple(matches), ignored_under_min=ignored
            )
        if matches:
            index = min(matches)
            start = matches[index]
            stop = stop_sequences[index].encode()
            out = outputs[n - 1].encode()
            cut = start + len(stop) if include_stop_sequence else start
            return Outcome(
                text=out[:cut].decode(),
                count=n,
                stop_reason="STOP_SEQUENCE",
                stop_sequence=stop_sequences[index],
                stop_index=index,
                matched=tuple(matches),
                spans_tokens=start < len(before.encode()),
                ends_inside_token=start + len(stop) < len(out),
                ignored_under_min=ignored,
            )
    return None


def _matches(output: str, before: str, stop_sequences: Sequence[str]) -> dict[int, int]:
    """Per stop sequence index: start of its rightmost occurrence that includes a newly added byte."""
    out, added = output.encode(), len(output.encode()) - len(before.encode())
    found: dict[int, int] = {}
    if added <= 0:
        return found
    for index, stop in enumerate(stop_sequences):
        s = stop.encode()
        hits = [
            p
            for p in range(len(out) - len(s) + 1)
            if out[p : p + len(s)] == s and p + len(s) > len(out) - added
        ]
        if hits:
            found[index] = max(hits)
    return found


def _final(decode: Decode, token_ids: Sequence[int]) -> str:
    """Text once a request ends without trimming: everything decoded, trailing U+FFFD removed."""
    return decode(token_ids).rstrip(REPLACEMENT)
