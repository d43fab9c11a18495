"""Plain value objects shared by every layer: request parameters, token details, output deltas."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class StopReason(enum.IntEnum):
    """Why a request stopped; values equal the wire enum `fmaas.StopReason`."""

    NOT_FINISHED = 0
    MAX_TOKENS = 1
    EOS_TOKEN = 2
    CANCELLED = 3
    TIME_LIMIT = 4
    STOP_SEQUENCE = 5
    TOKEN_LIMIT = 6
    ERROR = 7


class GenerationHealth(enum.Enum):
    """Outcome of the engine's latest forward pass (SPEC §11); UNKNOWN until the first one."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    FAILED = "failed"


class DecodingMethod(enum.IntEnum):
    GREEDY = 0
    SAMPLE = 1


class ModelKind(enum.IntEnum):
    DECODER_ONLY = 0
    ENCODER_DECODER = 1


@dataclass(frozen=True)
class LengthPenalty:
    """Exponential EOS boost once `start_index` tokens have been generated (SPEC §2.2)."""

    start_index: int
    decay_factor: float


@dataclass(frozen=True)
class SamplingParams:
    """Effective sampling parameters; only meaningful when the method is SAMPLE."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 0.0
    seed: int | None = None
    min_p: float = 0.0  # vLLM's min_p (HTTP APIs only): drop tokens below min_p × the top probability


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling values a checkpoint's generation_config.json recommends (None: it names none); the
    OpenAI routes use them where a request leaves a value unset, as vLLM does."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


@dataclass(frozen=True)
class StoppingParams:
    max_new_tokens: int = 20
    min_new_tokens: int = 0
    time_limit_millis: int = 0
    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool = True
    # vLLM's stop_token_ids (OpenAI routes only): more ids that end the request as EOS does
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResponseOptions:
    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0
    # Input token details carry logprobs, ranks and top tokens where asked; False (DISABLE_PROMPT_LOGPROBS):
    # the tokens alone, and no prompt logits are computed for them.
    input_scores: bool = True


@dataclass(frozen=True)
class BeamParams:
    """Beam search (vLLM's `use_beam_search` extra, HTTP APIs only): `width` beams, ranked by their
    summed log-probabilities over generated length ** `length_penalty`, with transformers'
    `early_stopping` rule (True, False or "never")."""

    width: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False


@dataclass(frozen=True)
class GenerationParams:
    """Effective parameters of one call (SPEC §2.1), before per-input seeding and clamping."""

    method: DecodingMethod = DecodingMethod.GREEDY
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    response: ResponseOptions = field(default_factory=ResponseOptions)
    repetition_penalty: float = 1.0
    length_penalty: LengthPenalty | None = None
    truncate_input_tokens: int = 0
    # OpenAI-style additive penalties on generated tokens (HTTP APIs only; gRPC leaves them at 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # TGI's green-list watermark (Kirchenbauer et al.): (gamma, delta), or None (TGI REST API only).
    watermark: tuple[float, float] | None = None
    # vLLM's bad_words (HTTP APIs only), as token sequences: none of them is ever completed.
    bad_words: tuple[tuple[int, ...], ...] = ()
    beam: BeamParams | None = None  # beam search instead of one sampled sequence (HTTP APIs only)

    @property
    def is_greedy(self) -> bool:
        """SAMPLE with an explicit temperature of 0 decodes greedily (SPEC §15, decision 3)."""
        return self.method == DecodingMethod.GREEDY or self.sampling.temperature == 0.0


@dataclass(frozen=True)
class TopToken:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenDetail:
    """Scores of one token; fields left at their zero value unless requested."""

    token_id: int
    logprob: float = 0.0
    rank: int = 0
    top_tokens: tuple[TopToken, ...] = ()


@dataclass(frozen=True)
class TokenInfo:
    """A token as the client sees it: raw vocabulary string plus requested scores."""

    text: str
    logprob: float = 0.0
    rank: int = 0
    top_tokens: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class InputTokensEvent:
    """Sent once after prefill when input token details were requested."""

    tokens: tuple[TokenInfo, ...]


@dataclass(frozen=True)
class Beam:
    """One finished beam of a beam-search request: its text, its generated tokens' count, why it ended,
    the sum of its tokens' log-probabilities and its rank score (that sum over length ** penalty)."""

    text: str
    generated_token_count: int
    stop_reason: StopReason
    cumulative_logprob: float
    score: float


@dataclass(frozen=True)
class TokenEvent:
    """Progress of one request after a token; the last one carries the stop reason. A beam-search
    request has one event, its final one, whose `beams` hold every returned beam, best first (the
    event's own text and count are the best beam's)."""

    generated_token_count: int
    text: str
    token: TokenInfo | None = None
    stop_reason: StopReason = StopReason.NOT_FINISHED
    stop_sequence: str | None = None
    beams: tuple[Beam, ...] = ()

    @property
    def finished(self) -> bool:
        return self.stop_reason != StopReason.NOT_FINISHED


@dataclass(frozen=True)
class FailureEvent:
    """The request failed; `message` is client-visible (SPEC §3.2)."""

    message: str


GenerationEvent = InputTokensEvent | TokenEvent | FailureEvent
