"""Serves a GGUF with llama.cpp's HTTP server through xllamacpp until SIGINT or SIGTERM.

Run as a script by the llama.cpp peer environment's Python (not tgis's), so it imports nothing but the
standard library and xllamacpp, whose wheel holds llama.cpp's server as a library (`xllamacpp.Server`)
rather than a `llama-server` binary. `--info` prints the xllamacpp version and the CPU features its
llama.cpp build uses, as JSON, and exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from typing import Any

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="llama.cpp's server on one GGUF, through xllamacpp")
    p.add_argument("--info", action="store_true", help="print version and CPU features as JSON, exit")
    p.add_argument("--model", help="the GGUF file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--parallel", type=int, default=1, help="slots: requests decoded together")
    p.add_argument("--ctx-size", type=int, default=1024, help="KV cache tokens, split evenly over the slots")
    p.add_argument("--threads", type=int, default=-1, help="for decode and for prompt batches alike")
    p.add_argument("--cache-type", default="f16", help="KV cache type for K and V: f32, f16, bf16, q8_0")
    return p


def configure(xlc: Any, args: argparse.Namespace) -> Any:
    """xllamacpp's CommonParams as llama-server would build them from the same flags."""
    params = xlc.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size
    params.cont_batching = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    cache = getattr(xlc.ggml_type, f"GGML_TYPE_{args.cache_type.upper()}")
    params.cache_type_k = cache
    params.cache_type_v = cache
    return params


def info(xlc: Any) -> dict[str, str]:
    return {"version": str(xlc.__version__), "system_info": str(xlc.get_system_info())}


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    import xllamacpp as xlc

    if args.info:
        print(json.dumps(info(xlc)), flush=True)
        return 0
    if not args.model:
        print("--model is required", file=sys.stderr)
        return 2
    # Blocked before the server starts its threads, which inherit the mask: only sigwait sees them.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    server = xlc.Server(configure(xlc, args))
    print(f"listening on {server.listening_address}", flush=True)
    signal.sigwait(STOP_SIGNALS)
    del server  # its destructor stops the HTTP server and the slots' loop
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
