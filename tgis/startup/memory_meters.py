"""How the memory model's estimator measures: peak bytes of what the engine allocates, on CUDA from the
allocator's statistics, on CPU from a live-tensor probe under CPU_MEMORY_BUDGET_MB."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

from engines.base import Engine
from tgis.config import Settings
from tgis.startup.memory_probe import LiveTensorPeak, MemoryBudgetExceeded

MIB = 1 << 20

OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryBudgetExceeded)


class Meter(Protocol):
    """Peak memory of what the engine allocates, in bytes above what was live when it was made."""

    free_bytes: int  # what batches may use at most; a peak above it counts as out of memory

    def tracking(self) -> AbstractContextManager[None]:
        """Count allocations while inside (CPU probes count nothing outside)."""
        ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...


class CudaMeter:
    """torch.cuda's allocator statistics; free = the device's free memory (and the allocator's
    cached blocks) after loading, less `reserved_bytes` (the prompt cache)."""

    def __init__(self, device: torch.device, reserved_bytes: int = 0, process_fraction: float = 1.0) -> None:
        self.device = device
        release_cached(device)
        self.baseline = torch.cuda.memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - self.baseline
        if process_fraction < 1.0:
            free = min(free, int(process_fraction * total) - self.baseline)
        self.free_bytes = max(0, free - reserved_bytes)

    @contextmanager
    def tracking(self) -> Iterator[None]:
        yield

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.baseline)


class CpuMeter:
    """Live tensor bytes counted by a dispatch-mode probe; free = the configured budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.free_bytes = budget_bytes
        self._probe: LiveTensorPeak | None = None

    @contextmanager
    def tracking(self) -> Iterator[None]:
        probe = LiveTensorPeak(budget=self.free_bytes)
        self._probe = probe
        try:
            with probe:
                yield
        finally:
            self._probe = None

    def reset_peak(self) -> None:
        if self._probe is not None:
            self._probe.reset_peak()

    def peak(self) -> int:
        return 0 if self._probe is None else self._probe.peak


def meter_for(settings: Settings, engine: Engine) -> CudaMeter | CpuMeter | None:
    """The meter for the engine's device; None on CPU without CPU_MEMORY_BUDGET_MB."""
    device = engine.spec.device
    if device.type == "cuda":
        reserved = settings.prompt_cache_size_mb * MIB if settings.prefix_store_path else 0
        return CudaMeter(device, reserved, settings.cuda_process_memory_fraction)
    if settings.cpu_memory_budget_mb is None:
        return None
    return CpuMeter(settings.cpu_memory_budget_mb * MIB)


def release_cached(device: torch.device) -> None:
    """Give the CUDA allocator's cached blocks back, so that free memory and peaks start clean
    (on CPU, dropping the references already freed the tensors)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
