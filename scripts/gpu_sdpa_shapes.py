"""On a CUDA device: what SDPA's first call at a new shape costs, with torch's default choice of kernels
and with the server's (engines.common.avoid_per_shape_attention_builds: cuDNN's attention off), then the
same shapes again. A server meets a new shape almost every step (prompt lengths, cached contexts, batch
sizes), so a backend that builds a plan per shape pays it again and again. scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from engines.common import avoid_per_shape_attention_builds

SHAPES = 30  # new sequence lengths per case


def first_calls(heads: int, dim: int, dtype: torch.dtype, masked: bool, lengths: range) -> list[float]:
    """Milliseconds of one SDPA call at each length (query L positions over L + context keys)."""
    device = torch.device("cuda")
    context = 7 if masked else 0
    times = []
    for length in lengths:
        query = torch.randn(1, heads, length, dim, device=device, dtype=dtype)
        key = torch.randn(1, heads, length + context, dim, device=device, dtype=dtype)
        value = torch.randn_like(key)
        mask = None
        if masked:
            keys = torch.arange(length + context, device=device)
            mask = keys[None, :] <= (context + torch.arange(length, device=device))[:, None]
        torch.cuda.synchronize()
        started = time.perf_counter()
        F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def report(label: str, times: list[float]) -> None:
    print(f"{label:46s} median {statistics.median(times):8.2f} ms   max {max(times):8.2f} ms")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(torch.__version__, torch.cuda.get_device_name())
    cases = [(4, 32, torch.float16, False), (4, 32, torch.float16, True), (32, 64, torch.bfloat16, False)]
    start = 24
    for settings in ("default", "server"):
        if settings == "server":
            avoid_per_shape_attention_builds(torch.device("cuda"))
        print(f"== {settings}: cuDNN attention {'on' if torch.backends.cuda.cudnn_sdp_enabled() else 'off'}")
        for heads, dim, dtype, masked in cases:
            lengths = range(start, start + SHAPES)
            start += SHAPES
            label = f"{heads}x{dim} {dtype} {'masked' if masked else 'causal'}"
            report(f"{label}, new shapes", first_calls(heads, dim, dtype, masked, lengths))
            report(f"{label}, the same again", first_calls(heads, dim, dtype, masked, lengths))


if __name__ == "__main__":
    main()
