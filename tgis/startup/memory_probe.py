"""Peak memory of tensors allocated on CPU while a probe is active (torch dispatch mode)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class MemoryBudgetExceeded(MemoryError):
    """The live tensors allocated under a probe went over its budget (the CPU analogue of an OOM)."""


class LiveTensorPeak(TorchDispatchMode):
    """Counts the bytes of every tensor storage an op creates while the mode is active, until that
    storage is freed, and keeps the peak of that count.

    Storages that existed before the mode was entered (model weights) are not counted; a storage
    that an op returns again (views, in-place ops) is counted once; one that an op grows is counted
    at its new size. With a `budget`, the op that takes the count over it raises
    `MemoryBudgetExceeded`, so a probe stops before it really uses the memory it is looking for.
    """

    def __init__(self, budget: int | None = None) -> None:
        super().__init__()
        self.budget = budget
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) → bytes counted for it

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak = self.live

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        if self.budget is not None and self.live > self.budget:
            raise MemoryBudgetExceeded(f"{self.live} bytes live, over the budget of {self.budget} bytes")
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, nested and similar: no plain storage
            return
        if storage.device.type == "meta":
            return
        key = id(storage)
        size = storage.nbytes()
        known = self._sizes.get(key)
        if known is None:
            # torch keeps one Python object per live storage, so it dies when the storage does.
            finalizer = weakref.finalize(storage, self._release, key)
            finalizer.atexit = False
        elif known == size:
            return
        self._sizes[key] = size
        self.live += size - (known or 0)
        self.peak = max(self.peak, self.live)

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
