"""CUDA graphs for decode-only paged steps: captured once per bucketed batch size, then replayed.

A decode step launches a few hundred small kernels, and on a GPU the host launching them is the
bottleneck at small batches. A captured graph launches them all at once. A decode-only step of n
sequences runs the graph of the smallest bucket >= n (the buckets end at the largest batch itself): its
inputs (token ids, positions, KV slots, key lengths, block tables) are staged into the graph's static
buffer in one copy, the rows beyond n are padding that writes one scratch slot and attends one scratch
block, and the first n rows of the one output buffer all graphs share are the step's logits.

Attention inside a graph is the varlen kernel (engines/paged/ragged.py). Reading keys in place, its
shapes depend only on the bucket. Over gathered keys, the gather has a fixed size inside a graph, so
each bucket is captured at several workspace sizes (`tiers`, doubling), and a step replays the
smallest that holds its sequences' positions: it gathers at most twice what it needs.

`DecodeInputs`, buckets and tiers are plain torch, testable on any device; capture and replay need CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engines.paged import step_inputs
from engines.paged.staging import Field, Staging, layout
from engines.step import StepBatch

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
WARMUP_RUNS = 2  # eager runs before capture, so lazy initialisation (cuBLAS handles) happens outside it
MIN_TIER_PER_SEQUENCE = 256  # a bucket's smallest workspace: positions per sequence, rounded up to 2^k


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured at: the standard buckets below `max_batch`, then itself."""
    return (*(b for b in BUCKETS if b < max_batch), max_batch)


def bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `size` sequences (None: larger than every bucket)."""
    return next((bucket for bucket in buckets if bucket >= size), None)


def tiers(bucket: int, max_positions: int, capacity: int) -> tuple[int, ...]:
    """Gathered keys: the workspace sizes (positions) a bucket is captured at, doubling from its smallest
    up to what `bucket` sequences of `max_positions` hold, at most `capacity`."""
    high = min(bucket * max_positions, capacity)
    tier = 1 << (bucket * MIN_TIER_PER_SEQUENCE - 1).bit_length()
    out = []
    while tier < high:
        out.append(tier)
        tier *= 2
    return (*out, high)


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
    """One decode step padded to a bucket: [bucket] token ids, positions and KV slots (int64); the keys
    each row attends as lengths ([bucket], paged) or offsets into the gathered keys ([bucket + 1]), and
    [bucket, width] block tables (int32, as the kernel takes them)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    key_lengths: torch.Tensor
    block_tables: torch.Tensor

    @staticmethod
    def fields(
        batch: StepBatch, bucket: int, block_size: int, width: int, scratch_block: int, *, gathered: bool
    ) -> list[Field]:
        """The step's decode chunks, then padding rows: token 0 at position 0 of `scratch_block`, which
        no sequence owns, so their keys and values land where nothing reads them."""
        chunks = batch.decode
        pad = bucket - len(chunks)
        tables = [step_inputs.used_blocks(c, block_size) for c in chunks] + [()] * pad
        ends = [c.end for c in chunks] + [1] * pad
        keys = [0] if gathered else []
        for end in ends:
            keys.append(keys[-1] + end if gathered else end)
        return [
            Field([c.token_ids[0] for c in chunks] + [0] * pad),
            Field([c.start for c in chunks] + [0] * pad),
            Field(step_inputs.slots(chunks, block_size) + [scratch_block * block_size] * pad),
            Field(keys, torch.int32),
            Field(step_inputs.padded(tables, fill=scratch_block, width=width), torch.int32),
        ]

    @classmethod
    def upload(
        cls, fields: Sequence[Field], staging: Staging, out: torch.Tensor | None = None
    ) -> DecodeInputs:
        ids, positions, slots, keys, tables = staging.upload(fields, out)
        return cls(ids, positions, slots, keys, tables)


# (static inputs, gathered workspace rows or None) -> logits [bucket, V] float32
Forward = Callable[[DecodeInputs, int | None], torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    buffer: torch.Tensor  # the static inputs' bytes
    inputs: DecodeInputs


class DecodeGraphs:
    """The captured graphs of one engine's decode steps, by bucket (and by workspace tier when gathered)."""

    def __init__(
        self,
        block_size: int,
        width: int,
        scratch_block: int,
        buckets: Sequence[int],
        tiers_of: Callable[[int], Sequence[int]] | None = None,
    ) -> None:
        self.block_size = block_size
        self.width = width
        self.scratch_block = scratch_block
        self.buckets = tuple(buckets)
        self.tiers_of = tiers_of  # gathered keys: each bucket's workspace sizes
        self.replays = 0
        self._graphs: dict[tuple[int, int | None], _Captured] = {}

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def shapes(self) -> list[tuple[int, int | None]]:
        """Every (bucket, tier) to capture, largest first (they share one memory pool)."""
        return [
            (bucket, tier)
            for bucket in sorted(self.buckets, reverse=True)
            for tier in (sorted(self.tiers_of(bucket), reverse=True) if self.tiers_of else [None])
        ]

    def capture(self, forward: Forward, device: torch.device, staging: Staging) -> None:
        """Capture one graph per shape, sharing one memory pool."""
        pool = None
        for bucket, tier in self.shapes():
            fields = self._fields(StepBatch(), bucket)
            buffer = torch.empty(_bytes(fields), dtype=torch.uint8, device=device)
            static = DecodeInputs.upload(fields, staging, buffer)
            for _ in range(WARMUP_RUNS):
                forward(static, tier)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                forward(static, tier)
            pool = graph.pool()
            self._graphs[(bucket, tier)] = _Captured(graph, buffer, static)

    def shape_for(self, batch: StepBatch) -> tuple[int, int | None] | None:
        """The (bucket, tier) a step replays, or None when no graph fits it."""
        if not eligible(batch):
            return None
        bucket = bucket_for(len(batch.decode), self.buckets)
        if bucket is None or any(-(-c.end // self.block_size) > self.width for c in batch.decode):
            return None
        if self.tiers_of is None:
            return bucket, None
        positions = sum(c.end for c in batch.decode) + bucket - len(batch.decode)
        tier = next((t for t in sorted(self.tiers_of(bucket)) if t >= positions), None)
        return None if tier is None else (bucket, tier)

    def run(self, batch: StepBatch, staging: Staging, logits: torch.Tensor) -> torch.Tensor | None:
        """The step's logits [n, V] (rows of `logits`, the buffer every graph writes), or None when no
        graph fits the step."""
        shape = self.shape_for(batch)
        if shape is None or shape not in self._graphs:
            return None
        captured = self._graphs[shape]
        DecodeInputs.upload(self._fields(batch, shape[0]), staging, captured.buffer)
        captured.graph.replay()
        self.replays += 1
        return logits[: len(batch.decode)]

    def _fields(self, batch: StepBatch, bucket: int) -> list[Field]:
        gathered = self.tiers_of is not None
        return DecodeInputs.fields(
            batch, bucket, self.block_size, self.width, self.scratch_block, gathered=gathered
        )


def _bytes(fields: Sequence[Field]) -> int:
    return layout([torch.as_tensor(field.values, dtype=field.dtype) for field in fields])[1]
