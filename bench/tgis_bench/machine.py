"""What a benchmark report says about the machine: CPU and its vector extensions, cores, GPU with its
driver and CUDA, and the torch and transformers that ran."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MachineInfo:
    cpu: str
    cores: int
    torch: str
    torch_threads: int
    transformers: str
    python: str
    system: str
    gpu: str | None = None
    cpu_flags: str = ""  # the vector and matrix extensions the CPU has, which decide what runs natively
    cuda: str | None = None  # the CUDA torch was built with (torch.version.cuda)
    gpu_driver: str | None = None  # the NVIDIA driver (nvidia-smi, else /proc/driver/nvidia/version)


def machine_info() -> MachineInfo:
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    return MachineInfo(
        cpu=_cpu_model(),
        cores=usable_cores(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        transformers=transformers.__version__,
        python=platform.python_version(),
        system=f"{platform.system()} {platform.release()} {platform.machine()}",
        gpu=_gpu_name() if cuda else None,
        cpu_flags=" ".join(cpu_flags()),
        cuda=torch.version.cuda if cuda else None,
        gpu_driver=nvidia_driver() if cuda else None,
    )


def _gpu_name() -> str:
    import torch

    properties = torch.cuda.get_device_properties(0)
    return f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB)"


def nvidia_driver(proc_version: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The NVIDIA driver's version as nvidia-smi states it, else as the kernel module does."""
    try:
        answer = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        if answer.stdout.strip():
            return answer.stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return driver_from_proc(proc_version.read_text())
    except OSError:
        return None


def driver_from_proc(text: str) -> str | None:
    """The version on the `NVRM version: NVIDIA UNIX [Open] Kernel Module [for] x86_64  580.159.04 ...`
    line."""
    for line in text.splitlines():
        if "Kernel Module" in line:
            found = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", f" {line} ")
            if found:
                return found.group(1)
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# What decides how a CPU runs the benchmark's kernels: wider vectors, and native bf16, fp16 and int8 math.
VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The VECTOR_FLAGS this CPU has, in that order, from /proc/cpuinfo (x86 `flags`, Arm `Features`)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    have: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            have.update(value.split())
    return [flag for flag in VECTOR_FLAGS if flag in have]


def usable_cores() -> int:
    """The cores this process may run on (its affinity): the report's core count, the llama.cpp threads."""
    if sys.platform == "linux":
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
