"""Linear layers on the CPU through oneDNN with their weights packed once, at load (`prepack_linears`).

A plain `torch.addmm` re-lays the weight out for oneDNN's kernels on every call; packing it once in
oneDNN's blocked format (what inductor's freezing does for compiled CPU graphs) makes the same
matmuls 1.2–3.5× faster in bfloat16 and about 2.3× in float32 on an AVX-512 CPU, the more the
fewer tokens a step has (decode steps). The model keeps its modules: each `nn.Linear` and
transformers `Conv1D` computes through its packed copy, and its `weight` parameter keeps its shape,
dtype and device (peft reads them to build LoRA layers around it) but no longer holds the dense
values (nor does the memory-mapped checkpoint). The output embeddings are packed too unless they are
tied to the input embeddings, whose lookup needs the dense table (packing a copy would hold that
table twice): a lone token's 32000 x 2048 float32 head took 10.5 ms packed against 14.0 ms dense on
2 AVX2 cores. Packing a dtype needs oneDNN kernels for it on this CPU (bfloat16: avx_ne_convert, or
avx512bw, avx512vl and avx512dq); where oneDNN has none, the layers stay plain and the log says why.

A step of a few rows (decode at low concurrency, drafts) is bound by reading the weights, and oneDNN's
packed product reads them well below the memory's speed there. Up to KERNEL_ROWS rows, float32 layers go
through the CPU kernels' few-row product instead (cpu_products.cpp's few_rows_linear), which reads a dense
copy once per step: each packed float32 layer keeps one, so its weight is held twice (once packed, for
steps of more rows), unless the copies would take more than half the memory the OS reports available
(`_dense_copies`). While the product widened bfloat16 weights to float32, bfloat16 layers kept oneDNN
alone: on a 2-core AVX-512 Xeon with AMX (family 6, model 207), GPT-2-small's 48 layer weights in bfloat16
took 17.5-20 ms packed at every row count from 1 to 16, and 18 ms through that product at 1 row, 22 at 2,
32 at 4, 80 at 16. In float32 on that Xeon the product
led packed by 2-3 ms at 1-3 rows and fell behind from about 6 (41 against 31 ms at 12, 49-64 against
35-42 at 16, calls alone); yet served with a limit of 4 rows there, the benchmark model made 0.89-1.09x
the tokens/s of the limit of 16 at 1 to 16 streams (three alternated rounds; 0.89-0.97x at 16), no gain,
so KERNEL_ROWS holds on both. A tied head goes through the same product for as many rows, more through
F.linear.

On a CPU with AVX512_BF16 the product multiplies bfloat16 weights as they are (its bfloat16 dot product,
cpu_products.cpp), and bfloat16 layers keep a dense copy for it too, up to BF16_KERNEL_ROWS rows: on a
2-core AVX-512 EPYC (Zen 4, avx512_bf16, no AMX), GPT-2-small's 48 layer weights took 6.3 / 6.5 / 8.1 /
11.4 ms at 1 / 2 / 4 / 8 rows against oneDNN's packed 9.6 / 10.7 / 9.1 / 9.7 (medians of 41 calls of all
48, alternated in one process). On a CPU with AMX, oneDNN multiplies bfloat16 in its tiles and the
product does not pay: on a 2-core AVX-512 Xeon with AMX (family 6, model 167), the same 48 weights
took 10.1 / 11.5 / 14.0 / 17.4 ms through the product at 1 / 2 / 4 / 8 rows against oneDNN's 9.3 /
9.2 / 9.1 / 9.2 (medians of 11 alternated rounds, scripts/cpu_products_rows.py). There, and without
AVX512_BF16, bfloat16 layers keep oneDNN alone, their dense values released.

A packed call costs 35-75 µs however small its weight (2 AVX2 cores, float32), so weights under
PACK_MIN_BYTES stay dense: F.linear is faster there at every row count measured (see the constant),
and keeping them dense costs no memory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch
from transformers.pytorch_utils import Conv1D

from engines.common import amx_tiles, available_memory_bytes, own_remaining_tensors, return_freed_heap
from engines.paged import cpu_kernel
from engines.quantized import is_quantized

logger = logging.getLogger(__name__)

MIB = 1 << 20

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Up to this many rows, float32 layers and a tied head go through the kernels' few-row product. GPT-2-
# small's 48 layer weights (340 MB, float32, 2 AVX2 cores, in a spell where summing 340 MB took 17 ms),
# ms packed against the product: 31 / 22 at 1 row, 38 / 30-35 at 4, 47 / 38-39 at 8, 58 / 49-54 at 16,
# 79 / 87-95 at 32. Its 50257 x 768 tied head, F.linear against the product: 15 / 10 at 1 row, 61 / 16
# at 4, 65 / 34 at 16, 74 / 56 at 32.
KERNEL_ROWS = 16
# The same for bfloat16 layers, where the product multiplies them natively (AVX512_BF16): see above.
BF16_KERNEL_ROWS = 4
# Weights smaller than this stay dense. Float32 on 2 AVX2 cores (EPYC), a call of each of 12 weights in
# turn, median µs packed / dense: 128x384 67 / 18 at 1 row, 61 / 29 at 8, 140 / 183 at 128, 281 / 288 at
# 256; 896x128 80 / 31, 96 / 82, 324 / 320, 548 / 539. From 768x768 (2.4 MB) on, packed is as fast or
# faster: 228-299 / 231-282 at 1 row, 355-368 / 484-557 at 4-8, 1348 / 1700 at 128.
PACK_MIN_BYTES = 1 << 20
_pack_min_bytes = PACK_MIN_BYTES  # packing_every_size() lowers it to 0 for a while


def can_prepack(model: torch.nn.Module) -> str | None:
    """Why the model's linear layers cannot be packed, or None if they can."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return "the model is not on the CPU"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if parameter.dtype not in PACKABLE_DTYPES:
        return f"oneDNN's packed linear does not take {parameter.dtype}"
    return packing_unsupported(parameter.dtype)


@functools.cache
def packing_unsupported(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot pack `dtype` weights on this CPU, or None if it can. Asks oneDNN itself, once
    per process and dtype: packs a small weight and computes through it. torch's own check (bfloat16
    needs avx_ne_convert, or avx512bw, avx512vl and avx512dq) raises a RuntimeError naming what is
    missing, which becomes the reason, instead of failing the model's load."""
    # Small integers: exact in bfloat16, and so is every output (|sum| <= 32 * 3 * 2 < 256), whatever
    # order the kernel adds in, so a right product equals the plain one bit for bit.
    weight = (torch.arange(64 * 32) % 7 - 3).view(64, 32).to(dtype)
    inputs = (torch.arange(4 * 32) % 5 - 2).view(4, 32).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        got = torch.ops.mkldnn._linear_pointwise(inputs, packed, None, "none", [], "")
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} weights on this CPU ({_first_line(exc)})"
    if not torch.equal(got, torch.nn.functional.linear(inputs, weight)):
        return f"oneDNN's packed {dtype} linear computed a wrong product on this CPU"
    return None


@contextlib.contextmanager
def packing_every_size() -> Iterator[None]:
    """Inside, `prepack_linears` packs weights of any size: profile-step's thin twin, whose tiny layers
    stand for the model's packed ones, is loaded so."""
    global _pack_min_bytes
    _pack_min_bytes = 0
    try:
        yield
    finally:
        _pack_min_bytes = PACK_MIN_BYTES


def prepack_linears(model: torch.nn.Module, min_bytes: int | None = None) -> int:
    """Pack the weight of every plain linear layer of at least `min_bytes` (default PACK_MIN_BYTES) for
    oneDNN and route its forward through it; returns how many were packed (0 when `can_prepack` says
    no). Call once, after the model is on its device in its final dtype and before any adapter wraps
    its layers."""
    reason = can_prepack(model)
    if reason is not None:
        logger.info(f"Linear layers run unpacked: {reason}")
        return 0
    tied_head = _tied_output_embeddings(model)
    if type(tied_head) is torch.nn.Linear and tied_head.bias is None:
        tied_head.forward = types.MethodType(_tied_head_forward, tied_head)  # type: ignore[method-assign]
        logger.info(f"Tied LM head: up to {KERNEL_ROWS} rows through the CPU kernels' few-row product")
    threshold = _pack_min_bytes if min_bytes is None else min_bytes
    layers: list[Any] = []  # nn.Linear and Conv1D
    small = 0
    for module in model.modules():
        if module is tied_head or type(module) not in (torch.nn.Linear, Conv1D) or is_quantized(module):
            continue  # a quantized layer computes from its own weights (engines/quantized.py)
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        if type(weight.data) is not torch.Tensor or weight.dtype not in PACKABLE_DTYPES:
            continue  # sharded (DTensor) or quantized weights keep their own path
        if weight.numel() * weight.element_size() < threshold:
            small += 1
        else:
            layers.append(module)
    keep_dense, note = _dense_copies(layers)
    for module in layers:
        weight = module.weight
        dense = (weight.detach().t() if isinstance(module, Conv1D) else weight.detach()).contiguous()
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(dense)
        few_rows_weight = None
        if keep_dense and _few_rows(weight.dtype):
            # a copy of its own: `dense` may be a view of the memory-mapped checkpoint
            few_rows_weight = dense.clone() if dense.data_ptr() == weight.data_ptr() else dense
        module.__dict__["few_rows_weight"] = few_rows_weight  # a plain attribute, not a parameter
        module.few_rows = _few_rows(weight.dtype)
        module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
        # Shape, dtype and device stay readable; the dense values are released (or kept in
        # few_rows_weight).
        module.weight = torch.nn.Parameter(_placeholder(weight), requires_grad=False)
    if layers:
        own_remaining_tensors(model)
        return_freed_heap()
    kept = f"; {small} under {threshold} bytes stay dense (faster there)" if small else ""
    logger.info(f"Packed {len(layers)} linear layers for oneDNN{kept}{note}")
    return len(layers)


def _few_rows(dtype: torch.dtype) -> int:
    """Up to how many rows a packed layer of `dtype` computes through the few-row product on its dense
    copy (0: it keeps none)."""
    built = cpu_kernel.kernels()
    if built is None:
        return 0
    if dtype == torch.float32:
        return KERNEL_ROWS
    return BF16_KERNEL_ROWS if dtype == torch.bfloat16 and built.bf16_rows and not amx_tiles() else 0


def _dense_copies(layers: list[Any]) -> tuple[bool, str]:
    """Whether the layers about to be packed keep a dense copy for the few-row product (float32, and
    bfloat16 where it multiplies them natively), and what the log says of it: where the CPU kernels are
    built, and the copies take at most half the memory the OS reports available (a model that fills the
    machine keeps oneDNN alone)."""
    copies = sum(m.weight.numel() * m.weight.element_size() for m in layers if _few_rows(m.weight.dtype))
    if not copies:
        return False, ""
    available = available_memory_bytes()
    if available is not None and 2 * copies > available:
        return False, (
            f"; no dense copies for the few-row product: they would take {copies / MIB:.0f} MiB, more "
            f"than half of the {available / MIB:.0f} MiB available"
        )
    rows = max(_few_rows(m.weight.dtype) for m in layers)
    return True, (
        f"; their dense copies ({copies / MIB:.0f} MiB) serve steps of up to {rows} rows through "
        "the CPU kernels' few-row product"
    )


def _packed_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if self.few_rows_weight is not None or torch.compiler.is_compiling():
        # One dispatcher operator of the CPU kernels' build (engines/paged/cpu_products.cpp): the few-row
        # product on the dense copy up to `few_rows` rows, else oneDNN on the packed weight. Under
        # PT2_COMPILE (engines/compiled.py) inductor calls it as it is; it would lower mkldnn's own op
        # only for weights it packed itself.
        dense = self.few_rows_weight
        return torch.ops.tgis.packed_linear(x, self.packed_weight, self.bias, dense, self.few_rows)
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _tied_head_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """A tied LM head (dense: the input embeddings' lookup reads the same table): for a few rows on the
    CPU, the kernels' product that reads the table once (cpu_products.cpp's few_rows_linear); else, and
    under torch.compile, the plain matmul."""
    weight = self.weight
    if torch.compiler.is_compiling():  # first: tracing the kernel's lookup would break the graph
        return torch.nn.functional.linear(x, weight)
    kernel = cpu_kernel.few_rows_linear_kernel()
    if (
        kernel is None
        or x.device.type != "cpu"
        or x.dtype != weight.dtype
        or not weight.is_contiguous()
        or x.numel() > KERNEL_ROWS * x.shape[-1]
    ):
        return torch.nn.functional.linear(x, weight)
    return kernel(x, weight, None)


def _first_line(exc: BaseException) -> str:
    """The error's message without the C++ stack torch may append (one log line)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A tensor of the weight's shape, dtype and device that takes no memory (all strides 0)."""
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


def _tied_output_embeddings(model: torch.nn.Module) -> Any:
    """The output embeddings, if their weight is the input embeddings' (tied); else None."""
    output, input = (_embeddings(model, side) for side in ("output", "input"))
    if output is None or input is None or output.weight.data_ptr() != input.weight.data_ptr():
        return None
    return output


def _embeddings(model: torch.nn.Module, side: str) -> Any:
    getter = getattr(model, f"get_{side}_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except NotImplementedError:  # transformers' default for a model that does not say
        return None
