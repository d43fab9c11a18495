"""Rendezvous and process groups joining the ranks: gloo for step commands, gloo or NCCL for compute."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engines.hf_custom_tp.layers import Group

# Workers wait for the next step command for as long as the server idles; a dead peer still
# surfaces at once because gloo sees its connection close.
COMMAND_TIMEOUT = timedelta(days=365)
# Every rank runs the same step, so a collective waits only for peers doing identical work;
# anything this slow is a stuck rank.
COMPUTE_TIMEOUT = timedelta(seconds=300)
STORE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class Groups:
    commands: Group  # always gloo on CPU: tiny tensors, long waits
    compute: Group  # gloo on CPU, NCCL on CUDA


def master_store(addr: str, port: int, world_size: int) -> dist.TCPStore:
    """Rank 0's store; port 0 picks a free one (read it back from `.port`)."""
    return dist.TCPStore(
        addr, port, world_size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT
    )


def worker_store(addr: str, port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=STORE_TIMEOUT)


def _gloo(store: dist.Store, rank: int, world_size: int, addr: str, timeout: timedelta) -> Group:
    gloo: Any = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = timeout
    # Bind to the rendezvous address: all ranks share one host, and hostname lookup fails in
    # many containers.
    options._devices = [gloo.create_device(hostname=addr)]
    return gloo(store, rank, world_size, options)


def _nccl(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Group:
    nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009 - absent from CPU builds and their stubs
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, world_size, options)


def make_groups(store: dist.Store, rank: int, world_size: int, addr: str, device: torch.device) -> Groups:
    """Both groups, built in the same order on every rank (construction is itself a rendezvous)."""
    commands = _gloo(dist.PrefixStore("commands", store), rank, world_size, addr, COMMAND_TIMEOUT)
    compute_store = dist.PrefixStore("compute", store)
    if device.type == "cuda":
        compute = _nccl(compute_store, rank, world_size, COMPUTE_TIMEOUT)
    else:
        compute = _gloo(compute_store, rank, world_size, addr, COMPUTE_TIMEOUT)
    return Groups(commands=commands, compute=compute)
