"""The llama.cpp peer: llama.cpp's server on a GGUF conversion of the benchmark model.

llama.cpp is never a dependency of tgis. It runs either as a `llama-server` binary built from
llama.cpp's sources for this machine (`--llamacpp-server`), or through xllamacpp: `--llamacpp-python`
names the interpreter of a separate environment with `pip install xllamacpp`, which runs
`llamacpp_serve.py` (beside this module). The GGUF files are converted from the benchmark model
beforehand (docs/benchmarking.md).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgis_bench.load.workload import BenchRequest
from tgis_bench.machine import usable_cores
from tgis_bench.peers import gguf
from tgis_bench.peers.base import Progress

LAUNCHER = Path(__file__).with_name("llamacpp_serve.py")

# The KV cache holds what tgis's holds at the same precision: f32 or bf16 weights keep f32 or bf16
# K and V (as vLLM's and tgis's follow the model dtype); quantized weights keep llama.cpp's default.
CACHE_TYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}
DEFAULT_CACHE_TYPE = "f16"

STOP_TYPES = {"limit": "MAX_TOKENS", "eos": "EOS_TOKEN", "word": "STOP_SEQUENCE"}


@dataclass(frozen=True)
class LlamaCppPeer:
    """llama.cpp serving one GGUF with settings comparable to tgis's: one slot per concurrent request
    of the sweep's highest level, each with room for the longest request, every core, continuous
    batching."""

    program: Path  # a llama-server binary, or the interpreter of an environment with xllamacpp
    gguf_file: Path
    file_type: str  # what the GGUF's header says its weights are: F32, BF16, Q8_0...
    slots: int = 32
    slot_context: int = 1024  # tokens of KV cache per slot
    threads: int = 1
    native: bool = False  # program is a llama-server binary

    endpoint = "/completion"  # llama.cpp's own: it takes a prompt of token ids as they are
    # Its HTTP server closes the connection after a streamed answer although the answer says keep-alive:
    # a pooled connection would carry the next request into a closed socket.
    reuses_connections = False

    @classmethod
    def for_gguf(
        cls, program: Path, gguf_file: Path, *, slots: int, slot_context: int, native: bool = False
    ) -> LlamaCppPeer:
        file_type = gguf.file_type(gguf_file)
        return cls(program, gguf_file, file_type, slots, slot_context, usable_cores(), native)

    @property
    def name(self) -> str:
        # A native build and xllamacpp's can be measured in one run, on the same GGUF.
        return f"llama.cpp {self.file_type}" if self.native else f"llama.cpp {self.file_type} (xllamacpp)"

    @property
    def cache_type(self) -> str:
        return CACHE_TYPES.get(self.file_type, DEFAULT_CACHE_TYPE)

    def command(self, port: int) -> list[str]:
        launcher = [str(self.program)] if self.native else [str(self.program), str(LAUNCHER)]
        shared = [
            "--model",
            str(self.gguf_file),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(self.slots * self.slot_context),  # llama.cpp splits it evenly over the slots
            "--threads",
            str(self.threads),
        ]
        if not self.native:
            return [*launcher, *shared, "--cache-type", self.cache_type]
        return [
            *launcher,
            *shared,
            "--threads-batch",
            str(self.threads),
            "--cache-type-k",
            self.cache_type,
            "--cache-type-v",
            self.cache_type,
            "--cont-batching",
            "--no-webui",
        ]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def describe(self) -> tuple[str, str]:
        version, features = self._native_build() if self.native else self._xllamacpp_build()
        settings = (
            f"`/completion` endpoint, {self.file_type} GGUF `{self.gguf_file.name}`, {self.slots} slots of "
            f"{self.slot_context} tokens, {self.threads} threads, continuous batching, KV cache "
            f"{self.cache_type}; {features}"
        )
        return f"llama.cpp ({version})", settings

    def _xllamacpp_build(self) -> tuple[str, str]:
        command = [str(self.program), str(LAUNCHER), "--info"]
        out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=300)
        info = json.loads(out.stdout.strip().splitlines()[-1])
        features = " ".join(build_features(info["system_info"])) or "none reported"
        return f"xllamacpp {info['version']}", f"its build uses the CPU features {features}"

    def _native_build(self) -> tuple[str, str]:
        out = subprocess.run(
            [str(self.program), "--version"], capture_output=True, text=True, check=True, timeout=60
        )
        lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
        version = next((line for line in lines if line.startswith("version:")), "version: unknown")
        built = next((line for line in lines if line.startswith("built with")), "")
        return f"llama-server {version.removeprefix('version:').strip()}", (
            f"a native build for this machine ({built})" if built else "a native build for this machine"
        )

    def body(self, request: BenchRequest) -> dict[str, Any]:
        return {
            "prompt": list(request.input_ids),  # ids are used as they are: no tokenizing, no BOS added
            "n_predict": request.max_new_tokens,
            "ignore_eos": True,  # with n_predict: exactly max_new_tokens tokens
            "temperature": 0.0,  # greedy
            "stream": True,
            "return_tokens": True,  # each event lists the tokens it carries
        }

    def progress(self, event: dict[str, Any]) -> Progress:
        tokens = event.get("tokens")
        stop_type = event.get("stop_type") if event.get("stop") else None
        generated, evaluated = event.get("tokens_predicted"), event.get("tokens_evaluated")
        return Progress(
            tokens=len(tokens) if isinstance(tokens, list) else 0,
            stop_reason=STOP_TYPES.get(stop_type, str(stop_type).upper()) if stop_type else None,
            generated=int(generated) if generated is not None else None,
            input_tokens=int(evaluated) if evaluated is not None else None,
        )


def build_features(system_info: str) -> list[str]:
    """The CPU features a llama.cpp build was compiled to use, from its system info line:
    `CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | ...` gives `["SSE3", "AVX2"]`."""
    _, _, flags = system_info.partition(":")
    features = []
    for part in flags.split("|"):
        name, _, value = part.partition("=")
        if name.strip() and value.strip() == "1":
            features.append(name.strip())
    return features
