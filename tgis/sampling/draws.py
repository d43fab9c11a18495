"""Seeded draws for a whole batch in one call: each row's uniform comes from its own (seed, draw index),
so a request draws the same numbers whatever batch it is in, on any device.

A draw picks the token whose cumulative probability first exceeds u × total (inverse-CDF sampling, an
exact draw from the row's distribution): one uniform per row, computed on the host by SplitMix64 (a
counter-based generator: the n-th draw of a seed is a function of the two, no state to carry), sent
to the device in one copy, then one cumulative sum and one search over every sampling row at once.
Per-row torch generators needed one `exponential_` kernel launch per row per step (V numbers each).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """SplitMix64's output for the state `value` (Steele, Lea and Flood 2014)."""
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, draw: int) -> float:
    """The `draw`-th uniform in [0, 1) of `seed` (any uint64), with 53 random bits."""
    return (splitmix64(splitmix64(seed & MASK64) ^ draw) >> 11) * 2.0**-53


def categorical(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """One token per row of `probs` [n, V] (rows need not sum to 1), row i drawn with `uniforms[i]`:
    the first token whose cumulative probability exceeds u × the row's total. Cumulated in float64, so
    a token of probability 0 is never drawn (its cumulative sum equals the one before it) and u < 1
    keeps the target below the total."""
    u = torch.tensor(uniforms, dtype=torch.float64).to(probs.device, non_blocking=True)
    cumulative = probs.to(torch.float64).cumsum(dim=-1)
    target = u[:, None] * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, target, right=True)[:, 0]
    return chosen.clamp_(max=probs.shape[-1] - 1)
