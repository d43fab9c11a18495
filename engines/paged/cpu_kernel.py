"""The CPU decode-attention kernels (cpu_decode.cpp), compiled once per source, torch and CPU, with
the same build's linear products for a few rows (cpu_products.cpp: engines/cpu_prepack.py routes decode's
layers through them, engines/quantized.py its int8 layers).

Decode attention is most of a paged decode step on CPU when it gathers every sequence's blocks into a
padded copy first (GPT-2-small shape, 32 sequences of 200 positions, bfloat16, 2 cores: 11.5 ms per
layer through gather + SDPA, against 2.2 ms for all of the layer's matmuls). The kernel reads the
blocks in place. torch.utils.cpp_extension builds it with the machine's compiler into torch's
extension cache (TORCH_EXTENSIONS_DIR); where that fails, decode falls back to the pure-torch path
(and the linear layers to oneDNN alone).
The build targets the CPU it runs on (-march=native), so a cached build is reused only on a CPU with
the same instruction-set extensions (and the same Python: the build directory names its version). A
dead build's lock does not hang later starts (`await_build_lock`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# One translation unit, in this order: the products use the attention file's helpers, the shims
# (AOTInductor's calls of the operators) both files' operators.
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_products.cpp", "cpu_shims.cpp")
)
# The instruction sets the build targets: this CPU's. A test builds for an AVX2-only CPU instead
# (-march=x86-64-v3) to run the kernels' AVX2 paths on any x86 machine.
TARGET_FLAGS = ["-march=native"]
# A build holds `lock` in its directory while it compiles, and torch waits for that file to go however
# long it stays. A process killed mid-build (an OOM kill, a failed liveness probe) leaves it behind, and
# every later start on the same extension cache would hang there. A build takes 20-100 s on 2 cores; a
# lock older than this is a dead build's.
STALE_BUILD_LOCK_SECONDS = 600.0

# (query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, skip) -> (out, lse)
DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, int],
    tuple[torch.Tensor, torch.Tensor],
]
# (query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, scale,
# sliding_window) -> out: a whole decode layer's KV write and attention (cpu_decode.cpp's decode_layer)
DecodeLayerKernel = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        float,
        int,
    ],
    torch.Tensor,
]


# (x [..., dim], weight [outputs, dim], bias [outputs] or None) -> F.linear(x, weight, bias), for a few
# rows (linear layers and a tied LM head at decode: cpu_prepack)
FewRowsLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


# (rows int8 [m <= 8, dim], weight int8 [outputs, dim], weight's row sums int32 [outputs]) -> int32 sums
# [m, outputs], exactly torch._int_mm(rows, weight.t()): the VNNI sums that torch.ops.tgis.int8_linear
# (engines/quantized.py's int8 layers) takes up to 8 rows, exposed so that tests hold them to torch's.
Int8RowsProduct = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Kernels:
    decode_attention: DecodeKernel
    decode_layer: DecodeLayerKernel
    few_rows_linear: FewRowsLinear
    int8_rows: Int8RowsProduct | None  # None: this CPU has no AVX-512 VNNI
    bf16_rows: bool  # few_rows_linear multiplies bfloat16 weights as they are (AVX512_BF16)
    int4_rows: bool  # torch.ops.tgis.int4_linear runs here (AVX-512 VNNI or AVX2)
    int4_tiles: bool  # and takes weights laid out for the AMX tiles (engines/int4_layouts.py)
    # each operator of torch.ops.tgis (its name) mapped to the C declaration of its AOTInductor shim
    # (cpu_shims.cpp); empty where the build's symbols could not be made global
    aoti_shims: dict[str, str]


@functools.cache
def kernels() -> Kernels | None:
    """The compiled kernels, built on first use (about 20 s, then cached on disk); None if they cannot be."""
    source = "\n".join(path.read_text() for path in SOURCES)
    capability = torch.backends.cpu.get_cpu_capability()
    key = f"{source}\0{torch.__version__}\0{capability}\0{cpu_extensions()}\0{TARGET_FLAGS}"
    name = f"tgis_paged_cpu_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    started = time.monotonic()
    try:
        from torch.utils.cpp_extension import get_default_build_root, load_inline

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
        build_dir = Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}" / name
        build_dir.mkdir(parents=True, exist_ok=True)
        await_build_lock(build_dir)
        module = load_inline(
            name=name,
            build_directory=str(build_dir),
            cpp_sources=[source],
            functions=[
                "decode_attention",
                "decode_layer",
                "int8_rows",
                "has_int8_rows",
                "has_int4_rows",
                "has_int4_tiles",
                "has_bf16_rows",
                "aoti_shims",
            ],
            # -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, inlined from its headers.
            extra_cflags=[
                "-O3",
                *TARGET_FLAGS,
                "-fno-strict-aliasing",
                "-ffast-math",
                "-fopenmp",
                # only the module's entry point and the shims (`_global_shims`) are exported
                "-fvisibility=hidden",
                *vector_flags(capability),
            ],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        logger.warning(
            "CPU paged-attention kernel unavailable, attention gathers each sequence's blocks for SDPA "
            f"instead: {exc}"
        )
        return None
    _register_fake_kernels()
    logger.info(f"CPU paged-attention kernel ready in {time.monotonic() - started:.1f} s")
    int8_rows = module.int8_rows if module.has_int8_rows() else None
    return Kernels(
        module.decode_attention,
        module.decode_layer,
        torch.ops.tgis.few_rows_linear,
        int8_rows,
        bool(module.has_bf16_rows()),
        bool(module.has_int4_rows()),
        bool(module.has_int4_tiles()),
        _global_shims(module),
    )


def _global_shims(module: object) -> dict[str, str]:
    """The build's AOTInductor shims, after its shared object is made global (RTLD_GLOBAL): a package
    that calls them (engines/paged/exported_step.py) resolves them when it is loaded. Python opened the
    build with local symbols. Only the shims and the module's entry point are exported, so no other
    library's symbols are shadowed. Empty where the library cannot be reopened: packages call the
    operators through AOTInductor's proxy executor then."""
    path = getattr(module, "__file__", None)
    try:
        if path is None:  # ctypes would open the main program instead, and succeed
            raise OSError("the build's module names no shared object")
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except (OSError, AttributeError) as exc:  # AttributeError: no RTLD_NOLOAD (not Linux)
        logger.warning(f"the CPU kernels' operators are called through AOTInductor's proxy executor: {exc}")
        return {}
    return dict(module.aoti_shims())  # type: ignore[attr-defined]


def await_build_lock(
    build_dir: Path, stale_after: float = STALE_BUILD_LOCK_SECONDS, poll: float = 1.0
) -> None:
    """Wait while another process builds into `build_dir` (its `lock` file exists); once that lock is
    older than `stale_after` seconds its builder died, and the lock is removed so this build can run."""
    lock = build_dir / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            logger.warning(
                f"Removing {lock}, left {age:.0f} s ago by a process that died while building the CPU "
                "kernels; building them again"
            )
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            return
        time.sleep(poll)


def _register_fake_kernels() -> None:
    """Output shapes of the build's dispatcher operators (torch.ops.tgis: decode_layer, packed_linear,
    few_rows_linear, int8_linear and int4_linear), for tracing them into a compiled graph."""

    def decode_layer(query: torch.Tensor, *args: object) -> torch.Tensor:
        return query.new_empty(query.shape[2], query.shape[1], query.shape[3])

    def packed_linear(input: torch.Tensor, packed_weight: torch.Tensor, *rest: object) -> torch.Tensor:
        return input.new_empty(*input.shape[:-1], packed_weight.shape[0])

    def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: object) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def int8_linear(x: torch.Tensor, weight: torch.Tensor, *rest: object) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    def int4_linear(x: torch.Tensor, packed: torch.Tensor, *rest: object) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], packed.numel() * 2 // x.shape[-1])  # either layout: n * k / 2 bytes

    torch.library.register_fake("tgis::decode_layer")(decode_layer)
    torch.library.register_fake("tgis::packed_linear")(packed_linear)
    torch.library.register_fake("tgis::few_rows_linear")(few_rows_linear)
    torch.library.register_fake("tgis::int8_linear")(int8_linear)
    torch.library.register_fake("tgis::int4_linear")(int4_linear)


def vector_flags(capability: str) -> list[str]:
    """The macros that select torch's vector types (at::vec::Vectorized, which the kernels use) for
    this CPU's capability, as torch's own kernels are built for it; with none, at::vec falls back to
    plain loops (on any other capability: ARM, or a CPU with neither AVX2 nor AVX512)."""
    if capability not in ("AVX2", "AVX512"):
        return []
    return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]


def decode_kernel() -> DecodeKernel | None:
    """The decode-attention kernel (`kernels`), or None without a build."""
    built = kernels()
    return None if built is None else built.decode_attention


def few_rows_linear_kernel() -> FewRowsLinear | None:
    """The few-row linear product (`kernels`), or None without a build."""
    built = kernels()
    return None if built is None else built.few_rows_linear


def int8_rows_kernel() -> Int8RowsProduct | None:
    """The few-row int8 product (`kernels`), or None without a build or without AVX-512 VNNI."""
    built = kernels()
    return None if built is None else built.int8_rows


def decode_layer_kernel() -> DecodeLayerKernel | None:
    """The fused KV-write and decode-attention kernel (`kernels`), or None without a build."""
    built = kernels()
    return None if built is None else built.decode_layer


def cpu_extensions() -> str:
    """This CPU's instruction-set extensions (Linux's cpuinfo flags), part of the build's name: torch's
    capability says only AVX2 or AVX512, and a build from an AVX512 CPU with avx512_bf16, avx512_fp16
    or AMX, found in a shared extension cache, may use instructions another AVX512 CPU lacks (an
    illegal instruction kills the process; no fallback catches it)."""
    with contextlib.suppress(OSError):  # no /proc (not Linux): the processor's name is what is known
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86 / ARM
                return line.partition(":")[2].strip()
    return f"{platform.machine()} {platform.processor()}"
