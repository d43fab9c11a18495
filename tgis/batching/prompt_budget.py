"""How many prompt tokens the next paged step may carry beside the decoding sequences.

A prompt chunk makes every running stream wait for it. A step's time grows about linearly with the
tokens it computes, t ≈ fixed + per_token × tokens (decode and prompt tokens alike), so while B
sequences decode, a step takes on only the P prompt tokens with per_token × P ≤ STALL × (fixed +
per_token × B): a stream's inter-token latency stays within about 1 + STALL times its decode-only
one, whatever arrives. The line is fitted to the steps as they run (least squares over an exponential
window), so the budget follows the hardware: on a CPU a prompt token costs a sizeable part of a
decode step, while a GPU computes hundreds in about the same time and MAX_STEP_TOKENS is the only limit.
With nothing decoding, or before the fit has seen steps of different sizes, MAX_STEP_TOKENS is too.

The cap never starves a group of arrivals: every prompt still waiting may take PROMPT_TOKENS_PER_WAITING
tokens per step. Under a fixed cap the k-th of several prompts that arrive together would wait about k
prompts' worth of steps for its first token, and the decoding cohort would spread out over those steps.
Measured on the 2-core CPU, bfloat16: the shared-prefix benchmark at concurrency 32 went from 635-700
tok/s (a fixed cap, four runs) to 680-780 (this floor, two runs), and the mixed one at concurrency 16
kept its ITL p99 within 1.4-1.8x its p50.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL = 0.5  # extra time a step may spend on prompt tokens, as a fraction of a decode-only step
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

    def observe(self, tokens: int, seconds: float) -> None:
        """One step computed `tokens` tokens (decode and prompt) in `seconds`."""
        weight = 1.0 / (self.observations + 1) if self.observations < 1 / WINDOW else WINDOW
        self.observations += 1
        self.mean_tokens += weight * (tokens - self.mean_tokens)
        self.mean_seconds += weight * (seconds - self.mean_seconds)
        self.mean_tokens_squared += weight * (tokens * tokens - self.mean_tokens_squared)
        self.mean_tokens_seconds += weight * (tokens * seconds - self.mean_tokens_seconds)

    def step_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a step, once the steps seen tell them apart."""
        variance = self.mean_tokens_squared - self.mean_tokens**2
        if self.observations < MIN_OBSERVATIONS or variance < MIN_TOKEN_SPREAD**2:
            return None
        per_token = (self.mean_tokens_seconds - self.mean_tokens * self.mean_seconds) / variance
        fixed = self.mean_seconds - per_token * self.mean_tokens
        if per_token <= 0.0:
            return None  # tokens cost nothing measurable: no reason to hold prompts back
        return max(fixed, 0.0), per_token

    def cap(self, decoding: int, prefilling: int) -> int | None:
        """Prompt tokens the next step may hold while `decoding` sequences each add one token and
        `prefilling` ones wait for the rest of their prompt (None: only MAX_STEP_TOKENS limits them).

        While more sequences wait for their prompt than decode (a burst of arrivals), the batch is
        mostly empty: filling it quickly serves everyone better, and few streams wait meanwhile.
        Otherwise the cap is what the stall allows, but at least MIN_PROMPT_TOKENS and at least
        PROMPT_TOKENS_PER_WAITING for each waiting prompt."""
        cost = self.step_cost() if decoding and prefilling <= decoding else None
        if cost is None:
            return None
        fixed, per_token = cost
        affordable = int(STALL * (fixed / per_token + decoding))
        return max(affordable, MIN_PROMPT_TOKENS, PROMPT_TOKENS_PER_WAITING * prefilling)
