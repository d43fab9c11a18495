"""How many prompt tokens the next paged step may carry beside the decoding sequences.

A prompt chunk makes every running stream wait for it. A step's time grows about linearly with the
tokens it computes, t ≈ fixed + per_token × tokens (decode and prompt tokens alike); the line is
fitted to the steps as they run (least squares over an exponential window), so the budget follows
the hardware: on a CPU a prompt token costs a sizeable part of a decode step, while a GPU computes
hundreds in about the same time and MAX_STEP_TOKENS is the only limit. With nothing decoding, or
before the fit has seen steps of different sizes, MAX_STEP_TOKENS is the only limit too.

Once the steps have told the slope apart, it is kept while they stop doing so: a steady batch that only
decodes (every step the same size, give or take a sequence) says nothing about what a prompt token
costs, and the moving averages' spread fades in about a hundred such steps. The fixed part still
follows the recent steps. Without that, the first long prompt to arrive after a few seconds of steady
decoding went in at MAX_STEP_TOKENS, a step of up to 256 prompt tokens that every stream waited for. In
the long-prompt mix (16 streams, every 4th prompt 400 words; int4 on a 2-core AVX-512 EPYC) ITL p99
came to 1.60-2.03x p50 over four runs, and to 1.48-1.61x with the slope kept, paired with them.

The bound is on inter-token latency as clients see it: most tokens come from steps of the usual
decode batch (the token-weighted average of recent steps' decoding sequences), so a step may take up
to 1 + STALL times such a step, whatever else it holds. While the batch is at its usual size that
leaves STALL of a decode step for prompt tokens; when only a few sequences decode (a wave of
requests has just ended and the next arrives together) the same bound leaves room for far more
prompt tokens, so the wave fills the batch quickly without making the few streams wait past it.

The cap never starves a group of arrivals: every prompt still waiting may take PROMPT_TOKENS_PER_WAITING
tokens per step, up to what MAX_STALL allows. Under a fixed cap the k-th of several prompts that arrive
together would wait about k prompts' worth of steps for its first token.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL = 0.5  # extra time a step may take, as a fraction of a usual decode-only step
MAX_STALL = 0.9  # what the floor per waiting prompt may stretch it to (ITL p99 within 2x p50)
MIN_PROMPT_TOKENS = 16  # prompts keep moving however costly they are
PROMPT_TOKENS_PER_WAITING = 8  # and each prompt waiting in a group of arrivals moves at least this much
MIN_OBSERVATIONS = 8  # steps seen before the fit is trusted
MIN_TOKEN_SPREAD = 4.0  # standard deviation of step sizes (tokens) the fit needs to tell slope from noise
WINDOW = 0.05  # weight of the newest step in the fit's moving averages (about the last 20 steps)


@dataclass
class PromptBudget:
    observations: int = 0
    mean_tokens: float = 0.0
    mean_seconds: float = 0.0
    mean_tokens_squared: float = 0.0
    mean_tokens_seconds: float = 0.0
    mean_decoding: float = 0.0  # decoding sequences per step
    mean_decoding_squared: float = 0.0
    slope: float | None = None  # seconds per token, from the last steps that told it apart

    def observe(self, tokens: int, seconds: float, decoding: int = 0) -> None:
        """One step computed `tokens` tokens (decode and prompt) in `seconds`, `decoding` of its
        sequences decoding."""
        weight = 1.0 / (self.observations + 1) if self.observations < 1 / WINDOW else WINDOW
        self.observations += 1
        self.mean_tokens += weight * (tokens - self.mean_tokens)
        self.mean_seconds += weight * (seconds - self.mean_seconds)
        self.mean_tokens_squared += weight * (tokens * tokens - self.mean_tokens_squared)
        self.mean_tokens_seconds += weight * (tokens * seconds - self.mean_tokens_seconds)
        self.mean_decoding += weight * (decoding - self.mean_decoding)
        self.mean_decoding_squared += weight * (decoding * decoding - self.mean_decoding_squared)
        variance = self.mean_tokens_squared - self.mean_tokens**2
        # else the steps keep the slope they last told (once there were enough of them to trust)
        if self.observations >= MIN_OBSERVATIONS and variance >= MIN_TOKEN_SPREAD**2:
            per_token = (self.mean_tokens_seconds - self.mean_tokens * self.mean_seconds) / variance
            # tokens that cost nothing measurable: no reason to hold prompts back
            self.slope = per_token if per_token > 0.0 else None

    @property
    def usual_decoding(self) -> float:
        """The decode batch most recent tokens came from: each step counts once per token it gave."""
        return self.mean_decoding_squared / self.mean_decoding if self.mean_decoding > 0 else 0.0

    def step_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a step, once the steps seen tell them apart; the slope
        of the last fit they did while they no longer do (same-size steps), the fixed part from the
        recent steps."""
        if self.slope is None:  # set only once MIN_OBSERVATIONS steps are seen (observe)
            return None
        return max(self.mean_seconds - self.slope * self.mean_tokens, 0.0), self.slope

    def cap(self, decoding: int, prefilling: int) -> int | None:
        """Prompt tokens the next step may hold while `decoding` sequences each add one token and
        `prefilling` ones wait for the rest of their prompt (None: only MAX_STEP_TOKENS limits them).

        The step may take (1 + STALL) usual decode steps, but every prompt may move MIN_PROMPT_TOKENS
        and each waiting one PROMPT_TOKENS_PER_WAITING, as long as the step stays within
        (1 + MAX_STALL) usual decode steps."""
        cost = self.step_cost() if decoding else None
        if cost is None:
            return None
        fixed, per_token = cost
        usual = max(self.usual_decoding, decoding)
        this_step = fixed / per_token + decoding  # a decode-only step now, in tokens' worth of time
        allowed = int((1 + STALL) * (fixed / per_token + usual) - this_step)
        stretched = int((1 + MAX_STALL) * (fixed / per_token + usual) - this_step)
        waiting_floor = min(PROMPT_TOKENS_PER_WAITING * prefilling, stretched)
        return max(allowed, MIN_PROMPT_TOKENS, waiting_floor)
