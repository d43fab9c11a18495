"""Parallel replacements for linear and embedding layers, and the collectives they call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engines.base import EngineFatalError

# A c10d backend object (ProcessGroupGloo, ProcessGroupNCCL) used directly, outside the global
# default group so that several engines can live in one process; the stubs share no usable base.
Group = Any


class CollectiveError(EngineFatalError):
    """A collective failed (a peer died or timed out); the ranks can no longer agree on state."""


def wait(work: dist.Work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise CollectiveError(f"hf_custom_tp: {what} across shards failed: {exc}") from exc


@dataclass(frozen=True)
class Shard:
    """This process's place in the tensor-parallel world, plus the group that joins the ranks."""

    rank: int
    world_size: int
    group: Group | None = None  # None only when world_size == 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.world_size > 1:
            wait(self.group.allreduce([tensor]), "all-reduce")
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` (equal shapes) along the last dim, in rank order."""
        if self.group is None or self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        wait(self.group.allgather([parts], [tensor]), "all-gather")
        return torch.cat(parts, dim=-1)


def rank_range(size: int, shard: Shard) -> tuple[int, int]:
    """[start, end) of this rank's chunk of `size`; chunks are ⌈size/world⌉ long, the last may be short."""
    chunk = -(-size // shard.world_size)
    start = min(shard.rank * chunk, size)
    return start, min(start + chunk, size)


class ColumnParallelLinear(nn.Module):
    """Holds this rank's output features; the result stays split, so no communication."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)
        return out if self.bias is None else out + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of x @ W^T (quantized layers replace it: engines/quantized.py)."""
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Holds this rank's input features; partial sums are all-reduced, then the bias is added once."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, shard: Shard) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shard.all_reduce(self.product(x))
        return out if self.bias is None else out + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums (quantized layers replace it: engines/quantized.py)."""
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Holds rows [start, end) of the vocabulary; ids outside look up zeros, then ranks sum."""

    def __init__(self, weight: nn.Parameter, start: int, shard: Shard) -> None:
        super().__init__()
        self.weight = weight
        self.start = start
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = self.lookup(local.masked_fill(outside, 0))
        out = out.masked_fill(outside[..., None], 0.0)
        return self.shard.all_reduce(out)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's table (a quantized table replaces it: engines/quantized.py)."""
        return F.embedding(local_ids, self.weight)


class VocabParallelHead(nn.Module):
    """Holds rows [start, end) of the output vocabulary; every rank ends with the full logits."""

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, vocab_size: int, shard: Shard
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.vocab_size = vocab_size
        self.shard = shard
        self.chunk = -(-vocab_size // shard.world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.product(x)
        if self.bias is not None:
            local = local + self.bias
        # all_gather needs equal shapes: the last rank's chunk may be short when the vocab does not divide.
        short = self.chunk - local.shape[-1]
        if short:
            local = F.pad(local, (0, short))
        return self.shard.all_gather_last(local)[..., : self.vocab_size]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the logits (quantized layers replace it: engines/quantized.py)."""
        return F.linear(x, self.weight)
