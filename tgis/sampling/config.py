"""Per-request sampling settings and the per-step sampler output."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tgis.types import GenerationParams, LengthPenalty, TokenDetail

_MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingConfig:
    """One request's effective per-step settings (SPEC §2.1-§2.2, §2.5).

    greedy: argmax decoding; the warpers and the seed are then ignored.
    temperature: > 0; 1.0 = no scaling.
    top_k: >= 0; 0 = disabled; values >= vocab size keep everything.
    top_p: in (0, 1]; 1.0 = disabled.
    typical_p: <= 1; used only when 0 < p < 1.
    min_p: in [0, 1]; 0 = disabled; tokens whose probability is below min_p × the top one's are dropped
        (after temperature, top-k and top-p, as transformers' MinPLogitsWarper and vLLM order it).
    seed: in [0, 2**64); with the row's draw count, picks its draws when sampling (tgis/sampling/draws.py).
    repetition_penalty: > 0; 1.0 = disabled.
    length_penalty: EOS boost after start_index generated tokens; decay_factor > 0.
    min_new_tokens: >= 0; EOS is suppressed until this many tokens are generated.
    stop_token_ids: the request's own ids that end it as EOS does; suppressed with EOS under min_new_tokens.
    presence_penalty / frequency_penalty: subtracted once / per occurrence from the logits of
        tokens already generated (OpenAI's definition); 0.0 = disabled.
    logit_bias: (token id, bias) pairs added to those logits every step.
    bad_words: token sequences the row never completes (tgis/sampling/bad_words.py).
    want_logprobs / want_ranks / top_n (>= 0): generated-token details to report.
    guide: the compiled guided-decoding grammar (xgrammar.CompiledGrammar), None when unconstrained;
        a guided row's EOS is never suppressed by min_new_tokens: the grammar decides when it ends.
    """

    greedy: bool
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 0.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    length_penalty: LengthPenalty | None = None
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    watermark: tuple[float, float] | None = None  # (gamma: green-list share, delta: bias added to it)
    want_logprobs: bool = False
    want_ranks: bool = False
    top_n: int = 0
    guide: object | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for problem in self._problems():
            raise ValueError(f"invalid SamplingConfig: {problem}")

    def _problems(self) -> list[str]:
        floats = [self.temperature, self.top_p, self.typical_p, self.min_p, self.repetition_penalty]
        floats += [self.presence_penalty, self.frequency_penalty, *(bias for _, bias in self.logit_bias)]
        if self.length_penalty is not None:
            floats.append(self.length_penalty.decay_factor)
        checks = {
            "every float must be finite": all(math.isfinite(value) for value in floats),
            "temperature must be > 0": self.temperature > 0,
            "top_k must be >= 0": self.top_k >= 0,
            "top_p must be in (0, 1]": 0 < self.top_p <= 1,
            "typical_p must be <= 1": self.typical_p <= 1,
            "min_p must be in [0, 1]": 0 <= self.min_p <= 1,
            "stop_token_ids must be >= 0": all(t >= 0 for t in self.stop_token_ids),
            "seed must be in [0, 2**64)": 0 <= self.seed <= _MAX_SEED,
            "repetition_penalty must be > 0": self.repetition_penalty > 0,
            "length_penalty decay_factor must be > 0": self.length_penalty is None
            or self.length_penalty.decay_factor > 0,
            "min_new_tokens must be >= 0": self.min_new_tokens >= 0,
            "top_n must be >= 0": self.top_n >= 0,
            "logit_bias ids must be >= 0": all(t >= 0 for t, _ in self.logit_bias),
            "bad_words must be non-empty sequences of ids >= 0": all(
                words and min(words) >= 0 for words in self.bad_words
            ),
        }
        return [message for message, ok in checks.items() if not ok]

    @property
    def counts_output(self) -> bool:
        """Whether the row needs its generated-token counts (presence or frequency penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def wants_details(self) -> bool:
        return self.want_logprobs or self.want_ranks or self.top_n > 0

    @classmethod
    def from_params(cls, params: GenerationParams, seed: int, guide: object | None = None) -> SamplingConfig:
        """Build from a call's effective params and this input's (already drawn) seed.

        Generated-token details are wanted only when generated tokens are returned.
        """
        response, sampling = params.response, params.sampling
        details = response.generated_tokens
        greedy = cls(
            greedy=True,
            repetition_penalty=params.repetition_penalty,
            length_penalty=params.length_penalty,
            min_new_tokens=params.stopping.min_new_tokens,
            stop_token_ids=params.stopping.stop_token_ids,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=params.logit_bias,
            bad_words=params.bad_words,
            watermark=params.watermark,
            want_logprobs=details and response.token_logprobs,
            want_ranks=details and response.token_ranks,
            top_n=response.top_n_tokens if details else 0,
            guide=guide,
        )
        if params.is_greedy:
            return greedy
        return replace(
            greedy,
            greedy=False,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            typical_p=sampling.typical_p,
            min_p=sampling.min_p,
            seed=seed,
        )


@dataclass
class StepSample:
    """The tokens chosen in one step, in batch row order."""

    token_ids: list[int]
    details: list[TokenDetail | None]  # None unless that row wants logprobs/ranks/top_n
    guide_finished: tuple[int, ...] = ()  # rows whose grammar terminated with this step's token
