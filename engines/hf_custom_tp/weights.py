"""Reads only this rank's slices of the safetensors checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engines.hf_custom_tp.layers import Shard, rank_range

NO_SAFETENSORS = "No safetensors weights found - required for hf_custom_tp engine"


class MissingWeightsError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class Segment:
    """A run of `size` entries along the split dim: divided among ranks, or copied whole to each."""

    size: int
    sharded: bool = True


@dataclass(frozen=True)
class Split:
    """Which part of a checkpoint tensor a rank takes.

    `dim=None` replicates the whole tensor. Otherwise each segment along `dim` (one spanning the
    whole dim when `segments` is None) contributes its rank slice, or all of itself when not sharded,
    and the pieces are concatenated in order: fused q|k|v layouts split per part this way.
    `transpose` turns GPT-2's Conv1D [in, out] layout into nn.Linear's [out, in].
    """

    dim: int | None = None
    segments: tuple[Segment, ...] | None = None
    transpose: bool = False


REPLICATED = Split()


def safetensors_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_path / name for name in names]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise MissingWeightsError(NO_SAFETENSORS)
    return files


class CheckpointReader:
    """Open safetensors files of one checkpoint; `read` returns just the requested slice."""

    def __init__(self, files: list[Path], shard: Shard) -> None:
        self.shard = shard
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        for path in files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._handles[key] = handle

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, key: str) -> bool:
        return key in self._handles

    def keys(self) -> Iterator[str]:
        return iter(self._handles)

    def shape(self, key: str) -> list[int]:
        return list(self._handles[key].get_slice(key).get_shape())

    def read(self, key: str, split: Split) -> torch.Tensor:
        view = self._handles[key].get_slice(key)
        if split.dim is None:
            tensor = view[:]
        else:
            full = view.get_shape()[split.dim]
            segments = split.segments or (Segment(full),)
            if sum(segment.size for segment in segments) != full:
                raise ValueError(f"{key}: segments {segments} do not cover its {full} entries")
            pieces, offset = [], 0
            for segment in segments:
                start, end = rank_range(segment.size, self.shard) if segment.sharded else (0, segment.size)
                index = [slice(None)] * len(view.get_shape())
                index[split.dim] = slice(offset + start, offset + end)
                pieces.append(view[tuple(index)])
                offset += segment.size
            tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=split.dim)
        return tensor.t().contiguous() if split.transpose else tensor
