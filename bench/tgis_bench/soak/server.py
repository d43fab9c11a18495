"""The server a soak runs against: a child process on a prepared model and adapter store, or another."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tgis_bench.health import await_health

logger = logging.getLogger(__name__)

LORA_ID = "soak-lora"
PREFIX_ID = "soak-prefix"
PREFIX_VIRTUAL_TOKENS = 8
PREFIX_STD = 0.02  # GPT-2's embedding init: a prefix the size of the model's own token embeddings
# A template for tokenizers without one (the demo and benchmark models), so the chat routes take part.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
STARTUP_SECONDS = 900.0
STOP_SECONDS = 120.0  # past the server's own shutdown grace for in-flight calls


@dataclass(frozen=True)
class ServerHandle:
    """A serving server: its addresses and, when this process started it, the child to watch."""

    grpc: str  # host:port
    http: str  # base URL
    pid: int | None = None  # RSS is read from /proc/<pid>; None: not on this machine or not known
    process: subprocess.Popen[bytes] | None = None

    def exit_code(self) -> int | None:
        """The child's exit status once it has exited; None while it runs (or when not a child)."""
        return self.process.poll() if self.process is not None else None

    def alive(self) -> bool:
        """False once the watched process has gone; True when there is none to watch."""
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is None or Path(f"/proc/{self.pid}").exists()


@dataclass(frozen=True)
class LaunchSettings:
    """The launched server's settings; `extra` adds or overrides environment variables."""

    max_batch_size: int = 16
    max_sequence_length: int = 1024
    max_new_tokens: int = 256
    extra: Mapping[str, str] = field(default_factory=dict)

    def environment(self, model_dir: Path, store: Path, grpc_port: int, http_port: int) -> dict[str, str]:
        return {
            **os.environ,
            "MODEL_NAME": str(model_dir),
            "SERVED_MODEL_NAME": model_dir.name,
            "PREFIX_STORE_PATH": str(store),
            "MAX_BATCH_SIZE": str(self.max_batch_size),
            "MAX_SEQUENCE_LENGTH": str(self.max_sequence_length),
            "MAX_NEW_TOKENS": str(self.max_new_tokens),
            "GRPC_PORT": str(grpc_port),
            "PORT": str(http_port),
            **self.extra,
        }

    def described(self) -> dict[str, str]:
        """The settings for the report (no paths)."""
        return {
            "MAX_BATCH_SIZE": str(self.max_batch_size),
            "MAX_SEQUENCE_LENGTH": str(self.max_sequence_length),
            "MAX_NEW_TOKENS": str(self.max_new_tokens),
            **self.extra,
        }


def prepare_model(source: Path, into: Path) -> Path:
    """`into/<source name>`: the files of `source` linked, plus a chat template if its tokenizer has none."""
    from transformers import AutoTokenizer

    view = into / source.name
    view.mkdir(parents=True)
    for path in source.iterdir():
        (view / path.name).symlink_to(path.resolve())
    if not getattr(AutoTokenizer.from_pretrained(source), "chat_template", None):
        (view / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return view


def prepare_store(model_dir: Path, store: Path, seed: int) -> None:
    """One LoRA adapter and one prompt-tuning prefix, written with peft as users' tools write them."""
    import torch

    from tgis.adapters import model_hidden_size
    from tgis.adapters.writers import write_lora, write_peft_prompt_tuning

    write_lora(store, LORA_ID, model_dir, seed=seed)
    hidden = model_hidden_size(json.loads((model_dir / "config.json").read_text()))
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(PREFIX_VIRTUAL_TOKENS, hidden, generator=generator) * PREFIX_STD
    write_peft_prompt_tuning(store, PREFIX_ID, embeddings, base_model_dir=model_dir)


def free_ports(count: int) -> list[int]:
    """Distinct free ports, held together while chosen."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


@contextlib.contextmanager
def launched(model_dir: Path, store: Path, settings: LaunchSettings, log: Path) -> Iterator[ServerHandle]:
    """Serve `model_dir` with this Python's tgis in a child process until the block ends (SIGTERM)."""
    grpc_port, http_port = free_ports(2)
    command = [sys.executable, "-c", "from tgis.cli import launcher_main; launcher_main()"]
    with log.open("wb") as output:
        process = subprocess.Popen(
            command,
            env=settings.environment(model_dir, store, grpc_port, http_port),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    handle = ServerHandle(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", process.pid, process)
    try:
        wait_healthy(handle, log)
        yield handle
    finally:
        stop(process)


def wait_healthy(handle: ServerHandle, log: Path | None = None, seconds: float = STARTUP_SECONDS) -> None:
    await_health(handle.http, handle.exit_code, seconds=seconds, log=log, probe_timeout=5.0)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        logger.warning(f"the server did not stop within {STOP_SECONDS:.0f} s of SIGTERM; killing it")
        process.kill()
        process.wait()
