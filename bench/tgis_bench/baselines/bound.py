"""The weights-bandwidth bound of a decode step: the weight bytes a step must read, over the bandwidth that a
device copy measured in the same run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tgis_bench.load.stats import RunSummary

if TYPE_CHECKING:
    import torch

GPU_COPY_BYTES = 1 << 30  # far beyond any GPU cache (an H100's L2 is 50 MB)
CPU_COPY_BYTES = 256 << 20  # far beyond a CPU's last-level cache, small enough beside the served model
COPY_REPEATS = 10


@dataclass(frozen=True)
class WeightTraffic:
    """What one decode step reads of the weights, in the dtype the server runs.

    A step reads every matrix whole, the output matrix (the LM head) included, but of an input embedding
    table only the rows of the tokens it feeds: those tables are left out (a tied table is the LM head and
    counts, once). The KV cache a step also reads is not in the bound.
    """

    parameters: int  # every distinct parameter, a tied matrix once
    read_parameters: int  # those a decode step reads whole
    lookup_tables: tuple[str, ...]  # the left-out embedding tables, by parameter name
    bytes_per_parameter: int

    @property
    def bytes_per_step(self) -> int:
        return self.read_parameters * self.bytes_per_parameter


@dataclass(frozen=True)
class CopyBandwidth:
    """A device-to-same-device copy of `bytes_copied` bytes, timed `len(seconds)` times after a warm-up.

    A copy reads its bytes once and writes them once, so it moves twice `bytes_copied`; the bound uses the
    best repetition (the bandwidth the memory can reach), the median is kept beside it.
    """

    device: str
    bytes_copied: int
    seconds: tuple[float, ...]
    timer: str  # how each repetition was timed

    @property
    def bytes_per_second(self) -> float:
        return 2 * self.bytes_copied / min(self.seconds)

    @property
    def median_bytes_per_second(self) -> float:
        return 2 * self.bytes_copied / statistics.median(self.seconds)


@dataclass(frozen=True)
class DecodeBound:
    """The fastest a decode step could run if reading the weights once were all it did."""

    weights: WeightTraffic
    bandwidth: CopyBandwidth

    @property
    def step_seconds(self) -> float:
        return self.weights.bytes_per_step / self.bandwidth.bytes_per_second

    def tokens_per_second(self, batch: int) -> float:
        """A step at batch `batch` makes `batch` tokens in `step_seconds`."""
        return batch / self.step_seconds

    def step_ratio(self, measured_step_seconds: float) -> float:
        """How many times the bound a measured step takes (1.0 would be the bound itself)."""
        return measured_step_seconds / self.step_seconds

    def throughput_share(self, tokens_per_second: float, batch: int) -> float:
        """A measured throughput over the bound's at that batch (1.0 would be the bound itself)."""
        return tokens_per_second / self.tokens_per_second(batch)


@dataclass(frozen=True)
class BoundRow:
    """One concurrency level of the sweep against the bound (seconds; None where the run has no figure)."""

    concurrency: int
    tokens_per_second: float
    bound_tokens_per_second: float  # the bound's at batch = concurrency
    throughput_share: float  # tokens_per_second / bound_tokens_per_second
    itl_p50: float | None
    itl_ratio: float | None  # ITL p50 / the bound's step
    step_seconds: float | None  # the server's mean decode step (its metrics)
    step_ratio: float | None  # step_seconds / the bound's step


def bound_rows(bound: DecodeBound, runs: Sequence[RunSummary]) -> list[BoundRow]:
    rows = []
    for run in sorted(runs, key=lambda r: r.concurrency):
        itl = run.inter_token.p50 if run.inter_token else None
        share = run.next_token_share
        step = share.mean_step_seconds if share and share.steps else None
        rows.append(
            BoundRow(
                concurrency=run.concurrency,
                tokens_per_second=run.tokens_per_second,
                bound_tokens_per_second=bound.tokens_per_second(run.concurrency),
                throughput_share=bound.throughput_share(run.tokens_per_second, run.concurrency),
                itl_p50=itl,
                itl_ratio=bound.step_ratio(itl) if itl else None,
                step_seconds=step,
                step_ratio=bound.step_ratio(step) if step else None,
            )
        )
    return rows


def decode_step_ratio(bound: DecodeBound, runs: Sequence[RunSummary]) -> float | None:
    """The measured decode step, ITL p50 at concurrency 1, over the bound's step (None without that run)."""
    single = next((run for run in runs if run.concurrency == 1 and run.inter_token), None)
    return bound.step_ratio(single.inter_token.p50) if single and single.inter_token else None


def bound_json(bound: DecodeBound, runs: Sequence[RunSummary]) -> dict[str, Any]:
    """The derived figures of the bound, for results.json beside its measured fields."""
    return {
        "bytes_per_step": bound.weights.bytes_per_step,
        "bytes_per_second": bound.bandwidth.bytes_per_second,
        "median_bytes_per_second": bound.bandwidth.median_bytes_per_second,
        "step_seconds": bound.step_seconds,
        "decode_step_ratio": decode_step_ratio(bound, runs),
        "rows": [asdict(row) for row in bound_rows(bound, runs)],
    }


def count_weight_traffic(model: torch.nn.Module, bytes_per_parameter: int) -> WeightTraffic:
    """Classify `model`'s parameters (real or on the meta device) into read whole and looked up by row."""
    import torch

    output_embeddings = getattr(model, "get_output_embeddings", None)  # a transformers model's LM head
    output_weight = getattr(output_embeddings(), "weight", None) if callable(output_embeddings) else None
    lookup_ids = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, torch.nn.Embedding) and module.weight is not output_weight
    }
    parameters = read = 0
    lookup_names = []
    for name, parameter in model.named_parameters():  # a tied parameter appears once
        parameters += parameter.numel()
        if id(parameter) in lookup_ids:
            lookup_names.append(name)
        else:
            read += parameter.numel()
    return WeightTraffic(parameters, read, tuple(lookup_names), bytes_per_parameter)


def weight_traffic(model_dir: Path, dtype: str) -> WeightTraffic:
    """The decode step's weight traffic of the model in `model_dir` run in `dtype`, from its config alone
    (the model is built on the meta device: no weights are read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return count_weight_traffic(model, element_size)


def measure_copy_bandwidth(device: torch.device, *, nbytes: int | None = None) -> CopyBandwidth:
    """Copy a buffer into another on `device` COPY_REPEATS times: CUDA events time each copy on a GPU,
    `time.perf_counter` around the (synchronous) copy on the CPU."""
    import torch

    size = nbytes or (GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
    source = torch.ones(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # untimed: the first touch of the target's pages, clocks up
    if device.type == "cuda":
        seconds = [_cuda_copy_seconds(source, target) for _ in range(COPY_REPEATS)]
        name, timer = f"{device} ({torch.cuda.get_device_name(device)})", "CUDA events"
    else:
        seconds = [_cpu_copy_seconds(source, target) for _ in range(COPY_REPEATS)]
        name, timer = f"cpu ({torch.get_num_threads()} threads)", "time.perf_counter"
    del source, target
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the baselines load the model next, in this process
    return CopyBandwidth(name, size, tuple(seconds), timer)


def _cuda_copy_seconds(source: torch.Tensor, target: torch.Tensor) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    target.copy_(source)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def _cpu_copy_seconds(source: torch.Tensor, target: torch.Tensor) -> float:
    started = time.perf_counter()
    target.copy_(source)
    return time.perf_counter() - started
