"""A step's integer inputs staged in one host buffer and sent to the device in one copy.

A step's inputs are a few hundred to a few thousand small integers in several tensors (token ids,
positions, KV slots, sequence offsets, block tables). Sent one by one with `.to(device)`, each is a
copy from pageable memory that waits for the device to finish all queued work before it starts, so
the host cannot run ahead of the GPU. Here they are written, each converted by torch from its Python
list in one call, into one byte buffer (pinned on CUDA, so the copy is a true asynchronous DMA),
at offsets aligned for their dtype, and copied once with `non_blocking=True`; every field is a typed
view of the device copy. On the CPU there is no copy: the fields are views of a fresh host buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # bytes; every field starts at a multiple (views of another dtype need aligned offsets)
MIN_PINNED_BYTES = 1 << 16


@dataclass(frozen=True)
class Field:
    """Integers for one tensor: a flat list, or rows of equal length (a 2-D tensor)."""

    values: Sequence[int] | Sequence[Sequence[int]]
    dtype: torch.dtype = torch.long


class Staging:
    """One device's staging buffer, reused step after step (pinned on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffer
        self.uploads = 0  # calls to upload (one per step: tests count them)

    def upload(self, fields: Sequence[Field], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The fields as tensors on the device, all views of one buffer filled by one copy: `out` (a
        uint8 device buffer at least as large, e.g. a CUDA graph's static inputs) or a new one."""
        host_fields = [torch.as_tensor(field.values, dtype=field.dtype) for field in fields]
        self.uploads += 1
        if self.device.type == "cpu" and out is None:
            return host_fields
        offsets, total = layout(host_fields)
        host = self._host_buffer(total)
        for tensor, offset in zip(host_fields, offsets, strict=True):
            _view(host, offset, tensor).copy_(tensor)
        device_bytes = out if out is not None else torch.empty(total, dtype=torch.uint8, device=self.device)
        device_bytes[:total].copy_(host[:total], non_blocking=self._pinned)
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [
            _view(device_bytes, offset, tensor) for tensor, offset in zip(host_fields, offsets, strict=True)
        ]

    def _host_buffer(self, size: int) -> torch.Tensor:
        """Room for `size` bytes on the host; the pinned buffer is reused once its last copy is done."""
        if not self._pinned:
            return torch.empty(size, dtype=torch.uint8)
        if self._copied is not None:
            self._copied.synchronize()  # normally long done: the step that used it has returned its logits
        if self._host.numel() < size:
            capacity = max(MIN_PINNED_BYTES, 1 << (size - 1).bit_length())
            self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        return self._host


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the buffer, and the buffer's size."""
    offsets, end = [], 0
    for tensor in tensors:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return offsets, end


def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    return buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)
