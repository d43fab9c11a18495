"""Which attention path serves the paged step on this device, at which KV block size, and why.

On CUDA, in order of preference (each checked on a small step against the kernel's torch stand-in):

1. `varlen_paged`: FlashAttention's varlen kernel reading keys from the KV blocks in place, where this
   torch's kernel takes a block table (torch 2.13's does, 2.11's does not) at the pool's block size.
   PyTorch's bundled FlashAttention 2 takes paged KV only in blocks of a multiple of 256 positions, so
   with KV_BLOCK_SIZE unset the block size is the first of AUTO_BLOCK_SIZES the kernel accepts.
2. `varlen_gathered`: the same kernel over keys packed per step, one gather per layer into a workspace
   reused by every layer; any block size (the path torch 2.11 gets).
3. `per_sequence`: torch alone (decode over padded gathers, prompt chunks one by one), with a WARNING.

On CPU: `cpu_kernel` (the C++ kernels) where they build, else `per_sequence` with a WARNING. Whatever is
chosen is logged (a WARNING names why a faster path does not serve) and reported to the service, which
publishes it as the `tgi_attention_path` metric.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engines.paged import cpu_kernel, ragged, step_context, varlen
from engines.paged.staging import Staging
from engines.paged.step_context import AttentionPath
from engines.paged.varlen import Kernel
from engines.step import SequenceChunk, StepBatch

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
# KV_BLOCK_SIZE unset, on CUDA where the kernel takes a block table: the first it accepts. 16 keeps
# prefix caching and the pool's rounding fine-grained; 256 is what PyTorch's FlashAttention 2 requires.
AUTO_BLOCK_SIZES = (16, 256)
PROBE_TOLERANCE = 2e-2  # of the outputs' magnitude: half-precision kernels against the float32 stand-in


@dataclass(frozen=True)
class Geometry:
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    windowed: bool  # some layer attends a sliding window


@dataclass(frozen=True)
class AttentionChoice:
    path: AttentionPath
    block_size: int
    kernel: Kernel | None = None  # the varlen paths' kernel
    fallback: str | None = None  # why a faster path does not serve (None: the best the device offers)


def choose(device: torch.device, geometry: Geometry, block_size: int | None) -> AttentionChoice:
    """The fastest path that passes its probe; `block_size` None picks it too."""
    if device.type != "cuda":
        size = block_size or DEFAULT_BLOCK_SIZE
        if cpu_kernel.decode_kernel() is not None:
            return AttentionChoice(AttentionPath.CPU_KERNEL, size)
        return AttentionChoice(
            AttentionPath.PER_SEQUENCE, size, fallback="the CPU attention kernel did not build"
        )
    offer = varlen.offer(device)
    reasons: list[str] = []
    if not offer.varlen:
        reasons.append(f"torch {torch.__version__} has no FlashAttention varlen kernel on {device}")
    elif geometry.windowed and not offer.window:
        reasons.append(f"torch {torch.__version__}'s FlashAttention varlen kernel takes no sliding window")
    else:
        if offer.paged:
            for size in (block_size,) if block_size else AUTO_BLOCK_SIZES:
                why = probe(AttentionPath.VARLEN_PAGED, size, geometry, device)
                if why is None:
                    return AttentionChoice(AttentionPath.VARLEN_PAGED, size, varlen.flash_varlen)
                reasons.append(f"the kernel refuses blocks of {size} positions in place ({why})")
        else:
            reasons.append(f"torch {torch.__version__}'s FlashAttention takes no block table")
        size = block_size or DEFAULT_BLOCK_SIZE
        why = probe(AttentionPath.VARLEN_GATHERED, size, geometry, device)
        if why is None:
            fallback = "; ".join(reasons)
            return AttentionChoice(AttentionPath.VARLEN_GATHERED, size, varlen.flash_varlen, fallback)
        reasons.append(f"the kernel over gathered keys failed its probe ({why})")
    return AttentionChoice(
        AttentionPath.PER_SEQUENCE, block_size or DEFAULT_BLOCK_SIZE, fallback="; ".join(reasons)
    )


def log(choice: AttentionChoice) -> None:
    how = {
        AttentionPath.VARLEN_PAGED: (
            "one FlashAttention varlen call per layer, keys read from the blocks in place"
        ),
        AttentionPath.VARLEN_GATHERED: (
            "one FlashAttention varlen call per layer over the step's keys, gathered once per layer into a "
            "reused workspace"
        ),
        AttentionPath.CPU_KERNEL: "the CPU kernels read the blocks in place",
        AttentionPath.PER_SEQUENCE: "torch alone, decode over padded gathers and prompt chunks one by one",
    }[choice.path]
    line = f"Paged attention ({choice.path}, blocks of {choice.block_size} positions): {how}"
    if choice.fallback is None:
        logger.info(line)
    else:
        logger.warning(f"{line}; not faster because {choice.fallback}")


def probe(path: AttentionPath, block_size: int, geometry: Geometry, device: torch.device) -> str | None:
    """Why the kernel cannot serve `path` at this geometry (None: it can). Runs a mixed step (two decode
    tokens and a prompt chunk over cached blocks) and a decode-only step (the kernel's other code path,
    with grouped-query heads packed) through the kernel and through its torch stand-in, which must
    agree: FlashAttention restricts block sizes, head sizes and dtypes, differently between versions."""
    generator = torch.Generator(device=device).manual_seed(0)
    blocks = 8

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(geometry.dtype)

    keys = random(blocks, block_size, geometry.kv_heads, geometry.head_dim)
    values = random(blocks, block_size, geometry.kv_heads, geometry.head_dim)
    decode = (_chunk(1, block_size + 2, (3, 1)), _chunk(1, 1, (6,)))
    steps = [
        StepBatch(decode=decode, prefill=(_chunk(4, 2 * block_size + 3, (0, 5, 2)),)),
        StepBatch(decode=decode),
    ]
    scale = geometry.head_dim**-0.5
    window = 3 if geometry.windowed else None
    for batch in steps:
        query = random(batch.num_tokens, geometry.heads, geometry.head_dim)
        try:
            got = _attend(path, batch, query, keys, values, varlen.flash_varlen, scale, window)
        except Exception as exc:  # the kernel refuses this geometry or dtype
            return f"the kernel failed: {exc}"
        want = _attend(path, batch, query, keys, values, varlen.reference_varlen, scale, window)
        deviation = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))
        if not deviation <= PROBE_TOLERANCE:
            return f"the kernel deviates by {deviation:.2g} from its torch stand-in"
    return None


def _attend(
    path: AttentionPath,
    batch: StepBatch,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kernel: Kernel,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    builder = step_context.StepBuilder(
        path,
        keys.shape[1],
        [keys],
        [values],
        Staging(keys.device),
        kernel,
        lambda positions: ragged.Workspace.empty(positions, keys),
    )
    layout = step_context.build(batch, builder).context.ragged
    assert layout is not None
    return ragged.attention(query, keys, values, layout, scale, window)


def _chunk(length: int, end: int, table: tuple[int, ...]) -> SequenceChunk:
    return SequenceChunk(tuple(range(length)), end - length, table, sample=True)
