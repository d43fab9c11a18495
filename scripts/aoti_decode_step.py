"""One sequence's decode forward on the CPU, compiled two ways in one process: torch.compile as
PT2_COMPILE compiled it before the package (engines/compiled.py's compile_model: the C++ wrapper, the
kernels' operators, one whole graph with the module guards skipped) and AOTInductor (torch.export, then
`aoti_compile_and_package`) of the fused step's forward that the server exports
(engines/paged/exported_step.py's FusedStepForward), here at this one step's shapes and with the weights
copied into the package as its constants. Both call the same operators of the CPU kernels' build; the
script prints each round's medians and their ratio, the tokens each picks, and the resident memory the
package's copied constants add (the server's package reads the model's own tensors instead).

    python scripts/aoti_decode_step.py --model-dir "$(.venv/bin/tgis-bench build-model)" --quantize int4
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines import hf_transformers
from engines.base import EngineConfig
from engines.compiled import compile_model
from engines.paged import step_context
from engines.paged.engine import PagedHFEngine
from engines.paged.exported_step import FusedStepForward, step_arguments
from engines.step import SequenceChunk, StepBatch

BLOCK_SIZE = 16
PROMPT_TOKENS = 64


def resident_mib() -> float:
    """This process's resident memory now (MiB), from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def median_ms(forward: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        forward(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--quantize", choices=["none", "int8", "int4"], default="none")
    parser.add_argument("--dtype", default=None, help="DTYPE (default: the CPU's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400, help="calls of each forward a round")
    options = parser.parse_args()

    config = EngineConfig(
        model_path=options.model_dir,
        dtype=options.dtype,
        paged=True,
        cpu_bf16=True,
        quantize=None if options.quantize == "none" else options.quantize,
    )
    engine = hf_transformers.load(config)
    assert isinstance(engine, PagedHFEngine)
    engine.allocate(64, BLOCK_SIZE)
    table = tuple(range(-(-(PROMPT_TOKENS + 1) // BLOCK_SIZE)))
    rng = random.Random(0)
    prompt = tuple(rng.randrange(engine.spec.vocab_size) for _ in range(PROMPT_TOKENS))
    engine.step(StepBatch(prefill=(SequenceChunk(prompt, 0, table, sample=True),)))
    decode = StepBatch(decode=(SequenceChunk((prompt[-1],), PROMPT_TOKENS, table, sample=True),))
    tensors = step_context.build(decode, engine._builder())
    context = tensors.context
    if context.fused is None:
        raise SystemExit("the CPU kernels' fused decode path is not available here")
    module = FusedStepForward(engine.model, engine.model.forward, context.fused.kernel).eval()
    args = (*step_arguments(tensors), list(context.key_caches), list(context.value_caches))
    with torch.inference_mode():
        eager = module(*args)

    before = resident_mib()
    started = time.perf_counter()
    with torch.no_grad():
        exported = torch.export.export(module, args, strict=False)
    with tempfile.TemporaryDirectory() as scratch:
        package = torch._inductor.aoti_compile_and_package(exported, package_path=f"{scratch}/decode.pt2")
        aoti = torch._inductor.aoti_load_package(package)
    print(
        f"AOTInductor: exported and compiled in {time.perf_counter() - started:.0f} s; "
        f"RSS {before:.0f} -> {resident_mib():.0f} MiB"
    )

    # PT2_COMPILE's own compilation of the kernels' operators, every call one whole graph
    compiled = compile_model(module, kernel_operators=True, whole_graph=lambda _kwargs: True)
    with torch.inference_mode():
        picks = {"eager": int(eager[0, -1].argmax())} | {
            name: int(forward(*args)[0, -1].argmax())
            for name, forward in (("AOTInductor", aoti), ("torch.compile", compiled))
        }
        drift = (aoti(*args) - eager).abs().max().item(), (compiled(*args) - eager).abs().max().item()
        print(
            f"next token: {picks}; largest logit difference from eager: AOTInductor {drift[0]:.4f}, "
            f"torch.compile {drift[1]:.4f}"
        )
        for _ in range(50):
            aoti(*args)
            compiled(*args)
        ratios = []
        for round_ in range(options.rounds):
            ahead = median_ms(aoti, args, options.calls)
            behind = median_ms(compiled, args, options.calls)
            ratios.append(ahead / behind)
            print(
                f"round {round_ + 1}: AOTInductor {ahead:.3f} ms, torch.compile {behind:.3f} ms, "
                f"ratio {ratios[-1]:.2f}",
                flush=True,
            )
    print(
        f"AOTInductor / torch.compile, median of {options.rounds} rounds: {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}); {torch.get_num_threads()} threads, torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
