"""Quantized linear layers and embeddings: the weights they hold and the product each call takes by row
count, through torch's own int8/int4 CPU kernels.

A layer keeps its module (peft wraps it for LoRA; tensor parallelism shards it before) and its `weight`
keeps its shape, dtype and device, but holds no values: the quantized weight is beside it.

- **int8**, per output channel (symmetric), with each row of activations quantized to int8 as it
  arrives (per token, symmetric) and multiplied in int8 with int32 sums (`torch._int_mm`, oneDNN's
  VNNI/AMX kernels). One product at every row count, and each row's result depends on that row alone:
  a step of many rows (a busy server, a speculative draft being verified) computes a sequence's next
  token exactly as a step of one does, so speculation stays exact and no request's text changes with
  the load. The weight-only product (`torch._weight_int8pack_mm`, activations in the model's dtype) was
  measured and dropped: a little faster at 1 row, far slower from 8 (GPT-2-small's 49 layer weights, a
  2-core AVX-512 EPYC, ms at 1 / 4 / 8 / 32 rows: weight-only 6.2 / 8.4 / 16.3 / 45.8, int8
  activations 6.7 / 10.0 / 10.7 / 18.0, packed bfloat16 8.8 / 9.4 / 9.6 / 18.1); keeping both would
  make a row's tokens depend on its step's width. On the CPU a layer is one call of the kernels' build
  (`torch.ops.tgis.int8_linear`, cpu_products.cpp): the rows quantized, the sums (up to 8 rows on a
  CPU with AVX-512 VNNI from its own kernel, which reads each weight once at the memory's pace; else
  torch._int_mm, the same integers), rescaled and the bias added. The same work as torch calls was
  about a dozen operators a layer, 1.3 ms of a lone stream's 8 ms step on GPT-2-small (2-core Zen 4:
  49 layers at one row, 3.3 against 4.6 ms), and one operator is what a compiled graph (PT2_COMPILE)
  calls from C++. Without the build, and off the CPU, the torch calls compute the same formula.
- **int4**, group-wise along the input (asymmetric: a scale and a zero per group). On a CPU with
  AVX-512 VNNI or AVX2 a layer is one call of the kernels' build (`torch.ops.tgis.int4_linear`,
  cpu_products.cpp) at every row count: the rows quantized to int8 as int8's are, exact int32 sums with
  the 4-bit values a group at a time, then each group's scale and zero point. torch's own product
  (`torch._weight_int4pack_mm_for_cpu`, activations in the model's dtype) read about half the bytes of
  int8 in more time: GPT-2-small's 48 layer weights at 1 / 4 / 8 / 32 rows took 2.9 / 4.7 / 8.9 / 34
  ms on a 2-core AVX-512 EPYC, the kernel 2.1 / 4.2 / 8.4 / 25, int8 3.2 / 4.7 / 9.5 / 16; built for
  AVX2 (torch's AVX2 kernels on the same machine) torch's took 5.9 / 7.2 / 15 / 50 ms, the kernel 2.1
  / 4.5 / 9.6 / 28. On a CPU with AMX-INT8 the kernels multiply 16 rows by 16 outputs a tile, the
  weight laid out for the tiles (`pack_int4_tiles`): on a 2-core Xeon with AMX the 48 weights took 2.3
  / 3.0 / 4.1 / 11 ms at 1 / 4 / 8 / 32 rows, the row kernel 2.3 / 3.8 / 6.8 / 28. A group size that is
  not a multiple of 64 takes torch's product. A checkpoint
  quantized with act-order (GPTQ's `desc_act`) has its input features permuted so that each group is
  contiguous; the call permutes the activations the same way.
- **Embeddings**, the input lookup, are int8 per row: a row is its int8 values times its scale. A tied
  LM head and its embeddings share one int8 table.

On CUDA the products are torch's GPU kernels where they pass a probe (engines/quantized_cuda.py), else
each dequantizes its weight for the call.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from engines import quantized_cuda
from engines.common import own_remaining_tensors, return_freed_heap
from engines.int4_layouts import TILE_OUTPUTS, kernel_int4_tensors
from engines.paged import cpu_kernel

INT4_LEVELS = 16  # 4 bits: 0..15, centred on 8
INT4_KERNEL_GROUPS = 64  # the kernels' int4 product takes groups of a multiple of this many features


@dataclass(frozen=True)
class Int4Weights:
    """One layer's int4 weight as the format it came from describes it, unpacked: `q[n, k]` in 0..15,
    and per group of `group_size` input features a scale and zero point with w = scale * (q - zero)."""

    q: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K / group_size] float
    zero: torch.Tensor  # [N, K / group_size] float (may be fractional: asymmetric min/max fits)
    group_size: int
    permutation: torch.Tensor | None = None  # [K]: input feature order that makes groups contiguous


def is_quantized(module: nn.Module) -> bool:
    return hasattr(module, "quantized")


def _entry(module: Any, product: Any, forward: Any) -> None:
    """A tensor-parallel layer (engines/hf_custom_tp/layers.py) computes its rank's part through
    `product` and adds the bias and the collective around it: only `product` is replaced there; a plain
    layer's `forward` is replaced whole (bias included)."""
    if hasattr(type(module), "product"):
        module.product = types.MethodType(product, module)
    else:
        module.forward = types.MethodType(forward, module)


# ---- quantizing dense weights ---------------------------------------------------------------------------


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as int8 values and a float32 scale per row (symmetric, round to nearest)."""
    dense = weight.detach().float()
    scale = dense.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(dense / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_groupwise(weight: torch.Tensor, group_size: int) -> Int4Weights:
    """`weight` [N, K] in groups of `group_size` input features: each group's minimum and maximum span
    the 16 levels (asymmetric), as llama.cpp's q4_1 and GPTQ/AWQ's zero points do."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"{k} input features do not split into groups of {group_size}")
    groups = weight.detach().float().view(n, k // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / (INT4_LEVELS - 1)).clamp(min=1e-12)
    zero = -low / scale  # w = scale * (q - zero): q = 0 at the minimum
    q = torch.round(groups / scale[..., None] + zero[..., None]).clamp(0, INT4_LEVELS - 1)
    return Int4Weights(q.to(torch.uint8).view(n, k), scale, zero, group_size)


def dequantize_int4(weights: Int4Weights) -> torch.Tensor:
    """The dense [N, K] float32 weight the int4 values stand for (in the checkpoint's feature order)."""
    n, k = weights.q.shape
    groups = weights.q.float().view(n, k // weights.group_size, weights.group_size)
    dense = ((groups - weights.zero[..., None]) * weights.scale[..., None]).view(n, k)
    if weights.permutation is not None:  # stored in group order: back to the input's order
        restored = torch.empty_like(dense)
        restored[:, weights.permutation] = dense
        return restored
    return dense


# ---- installing them in modules -------------------------------------------------------------------------


def install_int8(module: Any, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Make `module` (nn.Linear or transformers' Conv1D) compute from int8 `q` [N, K] and `scale` [N]."""
    module.quantized = "int8"
    module.q8_weight = q.contiguous()
    module.q8_scale32 = scale.float()
    module.q8_sums = q.sum(dim=1, dtype=torch.int32)  # for the few-row kernel's unsigned offset
    module.q8_kernel = module.weight.device.type == "cpu" and cpu_kernel.kernels() is not None
    module.q8_cuda_int_mm = quantized_cuda.int_mm_serves(q.shape, module.weight.device)
    _entry(module, _int8_product, _int8_forward)
    _release_dense(module, dtype)


def install_int4(module: Any, weights: Int4Weights, dtype: torch.dtype) -> None:
    """Make `module` compute from int4 `weights`: packed two values a byte for the kernels' int4 product
    (a CPU with AVX-512 VNNI or AVX2: `pack_int4`; with AMX tiles, outputs a multiple of 16:
    `pack_int4_tiles`), in torch's layout on another CPU, in tinygemm's on
    CUDA where it passed its probe (engines/quantized_cuda.py), else a byte a value, dequantized per call."""
    n, k = weights.q.shape
    module.quantized = "int4"
    module.q4_group = weights.group_size
    module.q4_permutation = weights.permutation
    module.q4_shape = (n, k)
    module.q4_tinygemm = False
    built = cpu_kernel.kernels() if module.weight.device.type == "cpu" else None
    module.q4_kernel = built is not None and built.int4_rows and weights.group_size % INT4_KERNEL_GROUPS == 0
    if module.q4_kernel:
        tiled = built is not None and built.int4_tiles and n % TILE_OUTPUTS == 0
        module.q4_nibbles, module.q4_scale32, module.q4_scaled_zero32 = kernel_int4_tensors(
            weights.q, weights.scale, weights.zero, weights.group_size, tiled
        )
    elif module.weight.device.type == "cpu":
        module.q4_scale_zero = torch_int4_scales(weights).to(dtype)
        module.q4_packed = torch._convert_weight_to_int4pack_for_cpu(
            weights.q.to(torch.int32).contiguous(), 1
        )
    elif fast := quantized_cuda.tinygemm_weight(
        weights.q.to(module.weight.device), torch_int4_scales(weights), weights.group_size
    ):
        module.q4_tinygemm = True  # plain tensor attributes, as every layout's: the weight bytes count them
        module.q4_tiles, module.q4_scale_zero = fast.packed, fast.scale_and_zero
    else:
        module.q4_values = weights.q.to(module.weight.device)
        module.q4_scale = weights.scale.to(module.weight.device, dtype)
        module.q4_zero = weights.zero.to(module.weight.device, dtype)
    _entry(module, _int4_product, _int4_forward)
    _release_dense(module, dtype)


def torch_int4_scales(weights: Int4Weights) -> torch.Tensor:
    """The groups' scales and zero points as torch's int4 products (the CPU's, tinygemm) take them:
    [groups, N, 2] float32 pairs (scale, zero') with w = (q - 8) * scale + zero', so zero' = scale * (8 -
    zero)."""
    zero_at_8 = weights.scale.float() * (INT4_LEVELS // 2 - weights.zero.float())
    return torch.stack([weights.scale.float(), zero_at_8], dim=2).transpose(0, 1).contiguous()


def install_int8_embedding(embedding: Any, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Make an input embedding look its rows up in the int8 table (shared with a tied head)."""
    embedding.quantized = "int8"
    embedding.q8_weight = q
    embedding.q8_scale32 = scale.float()
    embedding.q8_dtype = dtype
    if hasattr(type(embedding), "lookup"):  # a tensor-parallel table: its rank's rows
        embedding.lookup = types.MethodType(_int8_embedding_forward, embedding)
    else:
        embedding.forward = types.MethodType(_int8_embedding_forward, embedding)
    _release_dense(embedding, dtype)


def _release_dense(module: Any, dtype: torch.dtype) -> None:
    """The dense weight goes; a tensor of its shape, dtype and device that takes no memory stays (peft
    and the engine read the shape, dtype and device)."""
    weight = module.weight
    shape = weight.shape
    placeholder = torch.zeros((), dtype=dtype, device=weight.device).expand(shape)
    module.weight = nn.Parameter(placeholder, requires_grad=False)


# ---- the products ---------------------------------------------------------------------------------------


def _int8_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return _int8_linear(self, x, self.bias)


def _int8_product(self: Any, x: torch.Tensor) -> torch.Tensor:
    return _int8_linear(self, x, None)


def _int8_linear(self: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernels' one operator where `q8_kernel`, else the same formula in torch calls."""
    if self.q8_kernel:
        return torch.ops.tgis.int8_linear(x, self.q8_weight, self.q8_scale32, self.q8_sums, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = int8_activations_product(rows, self.q8_weight, self.q8_scale32, self.q8_cuda_int_mm)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def int8_activations_product(
    rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, cuda_int_mm: bool = False
) -> torch.Tensor:
    """`rows` [M, K] quantized to int8 per row (symmetric: the row's largest magnitude, floored at 1e-12,
    maps to 127), times int8 `q` [N, K] with a float32 `scale` per row of q, rescaled to the rows' dtype:
    what cpu_products.cpp's int8_linear computes, in torch calls (one int8 matmul with int32 sums on the
    CPU; on CUDA the same int32 sums through cuBLASLt where `cuda_int_mm`, else float32 sums)."""
    dense = rows.float()
    peak = dense.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    # 127 divided by the peak, as the kernel does (`127.0 / peak` would be a reciprocal times 127: a
    # value landing on .5 in one may not in the other, and round to another integer).
    quantized = torch.round(dense * torch.full_like(peak, 127.0).div(peak)).clamp(-127, 127).to(torch.int8)
    if quantized.device.type == "cpu":
        sums = torch._int_mm(quantized, q.t()).float()
    elif cuda_int_mm:
        sums = quantized_cuda.int8_sums(quantized, q).float()
    else:
        sums = quantized.float() @ q.float().t()
    return (sums * ((peak / 127.0) * scale)).to(rows.dtype)


def _int4_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return _int4_linear(self, x, self.bias)


def _int4_product(self: Any, x: torch.Tensor) -> torch.Tensor:
    return _int4_linear(self, x, None)


def _int4_linear(self: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernels' one operator where `q4_kernel` (int8 activations, bias included), else torch's int4
    product (the CPU's, or tinygemm on CUDA) or the weight dequantized for the call, plus the bias."""
    if self.q4_permutation is not None:  # act-order: the activations in the checkpoint's group order
        x = x.index_select(-1, self.q4_permutation)
    if self.q4_kernel:
        return torch.ops.tgis.int4_linear(
            x, self.q4_nibbles, self.q4_scale32, self.q4_scaled_zero32, self.q4_group, bias
        )
    rows = x.reshape(-1, x.shape[-1])
    if hasattr(self, "q4_packed"):
        out = torch._weight_int4pack_mm_for_cpu(
            rows.contiguous(), self.q4_packed, self.q4_group, self.q4_scale_zero
        )
    elif self.q4_tinygemm:
        out = quantized_cuda.tinygemm_product(rows, self.q4_tiles, self.q4_group, self.q4_scale_zero)
    else:
        n, k = self.q4_shape
        groups = self.q4_values.to(rows.dtype).view(n, k // self.q4_group, self.q4_group)
        dense = ((groups - self.q4_zero[..., None]) * self.q4_scale[..., None]).view(n, k)
        out = nn.functional.linear(rows, dense)
    out = out.view(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def _int8_embedding_forward(self: Any, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1)
    rows = self.q8_weight.index_select(0, flat).to(self.q8_dtype)
    rows = rows * self.q8_scale32.index_select(0, flat).to(self.q8_dtype)[:, None]
    return rows.view(*ids.shape, rows.shape[-1])


# ---- a whole model ---------------------------------------------------------------------------------------


def dense_weight(module: Any) -> torch.Tensor:
    """A linear layer's weight as [out, in] (transformers' Conv1D stores [in, out])."""
    weight = module.weight.detach()
    return weight.t() if isinstance(module, Conv1D) else weight


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Plain linear layers, and tensor-parallel ones (which compute through `product`)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m) in (nn.Linear, Conv1D) or hasattr(type(m), "product")
    ]


@dataclass(frozen=True)
class QuantizedModel:
    """What `quantize_model` did, for the log."""

    int8_layers: int
    int4_layers: int
    embeddings: int
    bytes_before: int
    bytes_after: int

    def summary(self, method: str) -> str:
        mib = 1 << 20
        layers = (
            f"{self.int4_layers} int4 and {self.int8_layers} int8"
            if method == "int4"
            else f"{self.int8_layers} int8"
        )
        return (
            f"QUANTIZE={method}: {layers} linear layers and {self.embeddings} embedding table(s); weights "
            f"{self.bytes_before / mib:.0f} MiB -> {self.bytes_after / mib:.0f} MiB"
        )


def quantize_model(model: nn.Module, method: str, group_size: int = 128) -> QuantizedModel:
    """Quantize every linear layer and the input embeddings of a loaded model in place (norms stay).

    As llama.cpp's quantized files do, the LM head (and the input embeddings, a table it is often tied
    to) stays at 8 bits whatever the method: q8_0 files keep everything at 8 bits, q4 files keep the
    output at 6-8. With `int4`, every other layer is int4 in groups of `group_size` input features
    (a layer whose input does not split into such groups stays int8)."""
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization method {method}")
    dtype = next(model.parameters()).dtype
    before = _weight_bytes(model)
    head = _module_or_none(model, "get_output_embeddings")
    embeddings = _module_or_none(model, "get_input_embeddings")
    tied = (
        head is not None and embeddings is not None and head.weight.data_ptr() == embeddings.weight.data_ptr()
    )
    int8 = int4 = tables = 0
    for _, module in linear_layers(model):
        weight = dense_weight(module)
        if method == "int4" and module is not head and weight.shape[1] % group_size == 0:
            install_int4(module, int4_groupwise(weight, group_size), dtype)
            int4 += 1
            continue
        q, scale = int8_per_channel(weight)
        if module is head and tied:
            assert embeddings is not None
            install_int8_embedding(embeddings, q, scale, dtype)
            tables += 1
        install_int8(module, q, scale, dtype)
        int8 += 1
    plain_table = type(embeddings) is nn.Embedding or hasattr(type(embeddings), "lookup")
    if embeddings is not None and not tied and plain_table:
        q, scale = int8_per_channel(embeddings.weight)
        install_int8_embedding(embeddings, q, scale, dtype)
        tables += 1
    return QuantizedModel(int8, int4, tables, before, _weight_bytes(model))


def _module_or_none(model: nn.Module, getter: str) -> Any:
    method = getattr(model, getter, None)
    try:
        return method() if callable(method) else None
    except NotImplementedError:  # transformers' default for a model that does not say
        return None


def _weight_bytes(model: nn.Module) -> int:
    """Bytes the model's tensors take (placeholders take none; a shared tensor counts once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            if tensor.dim() and not any(tensor.stride()):
                continue  # a placeholder
            seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def release_dense_weights(model: nn.Module, device: torch.device) -> None:
    """After quantizing: no tensor left a view of the memory-mapped checkpoint (which would keep it all
    resident), the heap trimmed, CUDA's cached blocks returned, so that the memory the KV pool is
    sized from is what the quantized weights leave."""
    own_remaining_tensors(model)
    return_freed_heap()
    if device.type == "cuda":
        torch.cuda.empty_cache()
