"""Entry point of ranks 1..N-1: load this rank's shard, then run rank 0's step commands until told to stop."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from engines.base import EngineConfig
from engines.hf_custom_tp.commands import CommandChannel, Stop
from engines.hf_custom_tp.engine import apply, load_shard, shard_device
from engines.hf_custom_tp.group import Groups, make_groups, worker_store
from engines.hf_custom_tp.layers import Shard
from engines.hf_transformers import HFTransformersEngine
from engines.paged.engine import PagedHFEngine

logger = logging.getLogger("engines.hf_custom_tp.worker")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engines.hf_custom_tp.worker")
    parser.add_argument("--model-path", required=True, type=Path)
    parser.add_argument("--dtype")
    parser.add_argument("--device")
    parser.add_argument("--attn-implementation")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--paged", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--quantize", choices=("int8", "int4"))
    parser.add_argument("--quantize-group-size", type=int, default=128)
    parser.add_argument("--kv-block-size", type=int)
    return parser.parse_args(argv)


def _exit_with_parent() -> None:
    """Exit when rank 0's process goes away, even if no collective is pending to notice it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    # A separate program launched per SPEC §9.3: its rank and rendezvous come from the environment.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s shard {rank} %(levelname)s %(message)s")
    _exit_with_parent()
    config = _engine_config(args, world_size)
    device = shard_device(config, rank)
    _use_device(device, world_size)
    store = worker_store(addr, port, world_size)
    engine, groups = _join_and_load(store, config, rank, world_size, addr, device)
    store.set(f"loaded/{rank}", "1")
    _run_commands(engine, CommandChannel(groups.commands))


def _engine_config(args: argparse.Namespace, world_size: int) -> EngineConfig:
    return EngineConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        attn_implementation=args.attn_implementation,
        num_shards=world_size,
        compile=args.compile,
        paged=args.paged,
        quantize=args.quantize,
        quantize_group_size=args.quantize_group_size,
        kv_block_size=args.kv_block_size,
    )


def _use_device(device: torch.device, world_size: int) -> None:
    """Make `device` this process's CUDA device, or on CPU take this rank's share of the cores."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    else:
        torch.cuda.set_device(device)


def _join_and_load(
    store: dist.Store, config: EngineConfig, rank: int, world_size: int, addr: str, device: torch.device
) -> tuple[HFTransformersEngine | PagedHFEngine, Groups]:
    """Join rank 0's process groups and load this rank's shard; a failure is left in the store for rank
    0 to report, then raised."""
    try:
        store.set(f"ready/{rank}", "1")
        groups = make_groups(store, rank, world_size, addr, device)
        engine = load_shard(config, Shard(rank, world_size, groups.compute), device)
    except Exception as exc:
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    return engine, groups


def _run_commands(engine: HFTransformersEngine | PagedHFEngine, channel: CommandChannel) -> NoReturn:
    """Apply rank 0's step commands until it says stop, then exit the process."""
    while True:
        command = channel.receive()
        if isinstance(command, Stop):
            logging.shutdown()
            # Nothing is left to clean up; skipping interpreter teardown (seconds with torch loaded)
            # keeps the server's shutdown within its deadline.
            os._exit(0)
        try:
            apply(engine, command)
        except Exception:
            # Rank 0 ran the same step on the same inputs and reports the failure to its requests.
            logger.exception(f"step {type(command).__name__} failed")


if __name__ == "__main__":
    sys.exit(main())
