"""CUDA graphs for decode-only paged steps: captured once per bucketed batch size, then replayed.

A decode step launches a few hundred small kernels, and on a GPU the host launching them is the
bottleneck at small batches. A captured graph launches them all at once. A decode-only step of n
sequences runs the graph of the smallest bucket >= n: its inputs (token ids, positions, KV slots, block
tables, sequence lengths) are copied into the graph's static buffers, the rows beyond n are padding
that writes one scratch slot and attends one scratch block, and the first n rows of the output are the
step's logits. Attention inside a graph is the ragged varlen kernel (engines/paged/ragged.py), whose
shapes depend only on the bucket.

`DecodeInputs` (what a step puts in the buffers) and the bucket choice are plain torch, testable on
any device; capture and replay need CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engines.paged import step_inputs
from engines.step import StepBatch

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
WARMUP_RUNS = 2  # eager runs before capture, so lazy initialisation (cuBLAS handles) happens outside it


def bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `size` sequences (None: larger than every bucket)."""
    return next((bucket for bucket in buckets if bucket >= size), None)


def eligible(batch: StepBatch) -> bool:
    """Whether a step can replay a decode graph: one sampled token per sequence, nothing else asked."""
    return (
        bool(batch.decode)
        and not batch.prefill
        and not batch.hidden
        and all(c.sample and not c.all_logits and c.lora is None and c.prefix is None for c in batch.decode)
    )


@dataclass(frozen=True)
class DecodeInputs:
    """One decode step padded to a bucket: [bucket] token ids, positions, KV slots and sequence lengths
    (int32, as the kernel takes them), and [bucket, width] block tables (int32)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor

    @classmethod
    def of(
        cls, batch: StepBatch, bucket: int, block_size: int, width: int, scratch_block: int
    ) -> DecodeInputs:
        """The step's decode chunks, then padding rows: token 0 at position 0 of `scratch_block`, which
        no sequence owns, so their keys and values land where nothing reads them."""
        chunks = batch.decode
        pad = bucket - len(chunks)
        positions = [c.start for c in chunks] + [0] * pad
        tables = torch.full((bucket, width), scratch_block, dtype=torch.int32)
        for row, chunk in enumerate(chunks):
            used = step_inputs.used_blocks(chunk, block_size)
            tables[row, : len(used)] = torch.tensor(list(used), dtype=torch.int32)
        slots = [c.block_table[c.start // block_size] * block_size + c.start % block_size for c in chunks] + [
            scratch_block * block_size
        ] * pad
        return cls(
            token_ids=torch.tensor([c.token_ids[0] for c in chunks] + [0] * pad, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slots=torch.tensor(slots, dtype=torch.long),
            seq_lens=torch.tensor([c.end for c in chunks] + [1] * pad, dtype=torch.int32),
            block_tables=tables,
        )

    def copy_into(self, static: DecodeInputs) -> None:
        for name in ("token_ids", "positions", "slots", "seq_lens", "block_tables"):
            getattr(static, name).copy_(getattr(self, name), non_blocking=True)


Forward = Callable[[DecodeInputs], torch.Tensor]  # static inputs -> logits [bucket, V] float32


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs
    logits: torch.Tensor


class DecodeGraphs:
    """The captured graphs of one engine's decode steps, by bucket."""

    def __init__(self, block_size: int, width: int, scratch_block: int, buckets: Sequence[int]) -> None:
        self.block_size = block_size
        self.width = width
        self.scratch_block = scratch_block
        self.buckets = tuple(buckets)
        self._graphs: dict[int, _Captured] = {}

    def capture(self, forward: Forward, device: torch.device) -> None:
        """Capture one graph per bucket, largest first, sharing one memory pool."""
        pool = None
        for bucket in sorted(self.buckets, reverse=True):
            static = self._static_inputs(bucket, device)
            for _ in range(WARMUP_RUNS):
                forward(static)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward(static)
            pool = graph.pool()
            self._graphs[bucket] = _Captured(graph, static, logits)

    def run(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's logits [n, V] from a replayed graph, or None when no graph fits the step."""
        bucket = bucket_for(len(batch.decode), self.buckets)
        if bucket is None or bucket not in self._graphs or not eligible(batch):
            return None
        captured = self._graphs[bucket]
        DecodeInputs.of(batch, bucket, self.block_size, self.width, self.scratch_block).copy_into(
            captured.inputs
        )
        captured.graph.replay()
        return captured.logits[: len(batch.decode)]

    def _static_inputs(self, bucket: int, device: torch.device) -> DecodeInputs:
        empty = DecodeInputs.of(StepBatch(), bucket, self.block_size, self.width, self.scratch_block)
        return DecodeInputs(*(tensor.to(device) for tensor in vars(empty).values()))
