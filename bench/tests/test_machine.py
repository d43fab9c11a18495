"""The machine facts a GPU report names beside the CPU's: the NVIDIA driver, the CUDA torch was built with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tgis_bench.machine import driver_from_proc, machine_info, nvidia_driver


@pytest.mark.parametrize(
    "line",
    [
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder)",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Sat Aug 19 01:15:15 UTC 2023",
    ],
    ids=["open", "proprietary"],
)
def test_the_driver_version_is_read_from_the_kernel_module_line(line):
    assert driver_from_proc(f"{line}\nGCC version:  gcc version 12.3.0\n") == "580.159.04"
    assert driver_from_proc("GCC version:  gcc version 12.3.0\n") is None


def test_without_nvidia_smi_the_kernel_module_names_the_driver(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi to run
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    )
    assert nvidia_driver(proc) == "550.54.15"
    assert nvidia_driver(tmp_path / "absent") is None


def test_a_machine_without_a_gpu_names_no_gpu_facts():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    info = machine_info()
    assert (info.gpu, info.cuda, info.gpu_driver) == (None, None, None)
    assert info.cores >= 1 and info.torch == torch.__version__
