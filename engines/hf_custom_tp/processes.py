"""The processes of ranks 1..N-1: how they are started (SPEC §9.3), checked, watched and stopped."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.base import EngineConfig, EngineFatalError

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
STARTUP_DEADLINE_SECONDS = 1800.0  # loading a large shard from slow storage takes a while
STOP_GRACE_SECONDS = 10.0
SIGBUS_HINT = (
    "; a shard killed by SIGBUS usually means /dev/shm is too small: give the container at least 1 GB"
    " of shared memory"
)


class ShardDiedError(EngineFatalError):
    pass


def exit_process(message: str) -> None:
    """Default reaction to a dead shard: the server cannot continue, so say why and exit non-zero.

    Mirrors TGIS's launcher, which stops every shard and exits when one dies; it also covers an idle
    server, where no step would ever run to raise the error.
    """
    logger.critical(f"{message}; stopping the server")
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen[bytes]

    def death(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        hint = SIGBUS_HINT if code == -signal.SIGBUS else ""
        return f"hf_custom_tp shard {self.rank} (pid {self.process.pid}) exited with code {code}{hint}"


class ShardProcesses:
    """The worker processes of ranks 1..N-1: spawned, checked, watched, stopped."""

    def __init__(self, workers: list[_Worker]) -> None:
        self.workers = workers
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def spawn(cls, config: EngineConfig, port: int) -> ShardProcesses:
        workers = []
        for rank in range(1, config.num_shards):
            command = [sys.executable, "-m", "engines.hf_custom_tp.worker", *worker_args(config)]
            # The workers inherit this environment (PYTHONPATH, HF_HUB_CACHE...) plus SPEC §9.3's variables.
            env = {**os.environ, **worker_env(config, rank, port)}
            workers.append(_Worker(rank, subprocess.Popen(command, env=env)))
            logger.info(
                f"hf_custom_tp: started shard {rank} of {config.num_shards} (pid {workers[-1].process.pid})"
            )
        return cls(workers)

    def first_death(self) -> str | None:
        for worker in self.workers:
            message = worker.death()
            if message:
                return message
        return None

    def check(self, grace: float = 0.0) -> None:
        """Raise ShardDiedError if a worker has exited, waiting up to `grace` seconds for one to."""
        deadline = time.monotonic() + grace
        while True:
            message = self.first_death()
            if message:
                raise ShardDiedError(message)
            if time.monotonic() >= deadline:
                return
            time.sleep(POLL_SECONDS)

    def wait_for(self, store: Any, stage: str) -> None:
        """Poll until every worker has set `<stage>/<rank>`; fail fast on a reported error or a death."""
        deadline = time.monotonic() + STARTUP_DEADLINE_SECONDS
        pending = {worker.rank for worker in self.workers}
        while pending:
            for rank in sorted(pending):
                if store.check([f"error/{rank}"]):
                    error = store.get(f"error/{rank}").decode()
                    raise RuntimeError(f"hf_custom_tp shard {rank} failed to start: {error}")
                if store.check([f"{stage}/{rank}"]):
                    pending.discard(rank)
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"hf_custom_tp shards {sorted(pending)} did not report {stage}")
            if pending:
                time.sleep(POLL_SECONDS)

    def watch(self, on_death: Callable[[str], None]) -> None:
        self._watching.set()
        self._watcher = threading.Thread(target=self._watch, args=(on_death,), name="tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        while self._watching.is_set():
            message = self.first_death()
            if message and self._watching.is_set():
                on_death(message)
                return
            time.sleep(0.2)

    def stop_watching(self) -> None:
        self._watching.clear()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(1.0)

    def join(self, timeout: float) -> None:
        """Wait for the workers to exit; kill the ones that do not."""
        self.stop_watching()
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()


def worker_args(config: EngineConfig) -> list[str]:
    args = ["--model-path", str(config.model_path)]
    if config.dtype:
        args += ["--dtype", config.dtype]
    if config.device:
        args += ["--device", config.device]
    if config.attn_implementation:
        args += ["--attn-implementation", config.attn_implementation]
    if config.trust_remote_code:
        args.append("--trust-remote-code")
    if config.compile:
        args.append("--compile")
    if config.paged is not None:
        args.append("--paged" if config.paged else "--no-paged")
    if config.quantize is not None:
        args += ["--quantize", config.quantize, "--quantize-group-size", str(config.quantize_group_size)]
    if config.kv_block_size is not None:
        args += ["--kv-block-size", str(config.kv_block_size)]
    return args


def worker_env(config: EngineConfig, rank: int, port: int) -> dict[str, str]:
    """SPEC §9.3's per-worker variables (one host: local rank = rank)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(config.num_shards),
        "LOCAL_SIZE": str(config.num_shards),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(port),
        "NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
        "SAFETENSORS_FAST_GPU": "1",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
    }
