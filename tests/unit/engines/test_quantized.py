"""Quantized layers compute what their quantized weights stand for: each product (by row count) against
F.linear on the dequantized weight, the int4 packing round trip, embeddings, and a whole model's
memory."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from engines.int4_layouts import kernel_int4_tensors, pack_int4_tiles, tile_scales
from engines.paged.cpu_kernel import cpu_extensions, int8_rows_kernel, kernels
from engines.quantized import (
    Int4Weights,
    dequantize_int4,
    install_int4,
    install_int8,
    install_int8_embedding,
    int4_groupwise,
    int8_per_channel,
    quantize_model,
)
from tests.fixtures.tiny import relative

N, K, GROUP = 48, 96, 32


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(0))


def test_int8_rounds_each_weight_to_within_half_a_step(weight: torch.Tensor) -> None:
    q, scale = int8_per_channel(weight)
    error = (q.float() * scale[:, None] - weight).abs()
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert bool((error <= scale[:, None] / 2 + 1e-6).all())


def _has_vnni() -> bool:
    flags = cpu_extensions().split()
    return "avx512_vnni" in flags and "avx512bw" in flags


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize(("outputs", "width"), [(96, 768), (17, 64), (33, 130), (5, 3072)])
def test_the_few_row_int8_kernel_gives_torch_int_mm_sums_exactly(rows, outputs, width) -> None:
    """Integer sums, so exactly torch's: widths off the 64-byte step exercise the masked tail. Without
    AVX-512 VNNI (an AVX2-only CPU) there is no kernel, and the product stays torch._int_mm."""
    kernel = int8_rows_kernel()
    if kernels() is None or not _has_vnni():
        assert kernel is None
        return
    assert kernel is not None
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randint(-128, 128, (rows, width), dtype=torch.int8, generator=generator)
    w = torch.randint(-128, 128, (outputs, width), dtype=torch.int8, generator=generator)
    assert torch.equal(kernel(x, w, w.sum(1, dtype=torch.int32)), torch._int_mm(x, w.t()))


def test_an_int8_layer_answers_alike_through_the_kernel_and_torch(weight) -> None:
    # A row's result must not depend on how many rows share its step (speculation stays exact); with a
    # bias, so that the rescaling's multiply-add is held to one rounding in both paths too.
    layer = nn.Linear(K, N)
    install_int8(layer, *int8_per_channel(weight), torch.float32)
    x = torch.randn(12, K)
    together = layer(x)  # 12 rows: torch._int_mm
    alone = torch.cat([layer(x[i : i + 1]) for i in range(12)])  # 1 row: the kernel, where there is one
    assert torch.equal(together, alone)
    assert layer(x[:0]).shape == (0, N)  # a step whose chunks keep no logits asks the head for none


def test_int4_rounds_each_weight_to_within_half_a_step_of_its_group(weight: torch.Tensor) -> None:
    weights = int4_groupwise(weight, GROUP)
    assert weights.q.dtype == torch.uint8 and int(weights.q.max()) == 15 and int(weights.q.min()) == 0
    error = (dequantize_int4(weights) - weight).abs().view(N, K // GROUP, GROUP)
    assert bool((error <= weights.scale[..., None] / 2 + 1e-5).all())


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int8_product_is_the_integer_product_of_weights_and_per_row_activations(weight, rows) -> None:
    """Each row of activations is quantized to int8 on its own: the product is exactly the integer
    product of both quantizations, rescaled (checked in float64), and near the dense product."""
    layer = nn.Linear(K, N, bias=True)
    q, scale = int8_per_channel(weight)
    bias = layer.bias.detach().clone()
    install_int8(layer, q, scale, torch.float32)
    x = torch.randn(rows, K)
    peak = x.abs().amax(1, keepdim=True)
    xq = torch.round(x * (127 / peak))
    expected = (xq.double() @ q.double().t()) * (peak / 127).double() * scale.double() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-5)
    dense = x @ weight.t() + bias
    assert float((layer(x) - dense).abs().max()) < 0.05 * float(dense.abs().max())
    assert layer.weight.shape == (N, K) and not any(layer.weight.stride())  # no values held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_an_int8_layer_is_one_kernel_call_computing_what_torch_calls_do(weight, dtype, with_bias) -> None:
    """On the CPU with the kernels built, an int8 layer is one dispatcher operator (tgis::int8_linear,
    what a compiled graph calls); the torch calls used without the build (and on CUDA) compute the same
    formula: the same int8 rows, so results within a float32 rounding of each other, at 1-8 rows (the
    VNNI kernel's) and more (torch._int_mm's)."""
    from torch.profiler import ProfilerActivity, profile

    assert kernels() is not None, "the CPU kernels must build on the test machine"
    layer: Any = nn.Linear(K, N, bias=with_bias).to(dtype)
    install_int8(layer, *int8_per_channel(weight), dtype)
    assert layer.q8_kernel
    for rows in (1, 8, 9, 33):
        x = torch.randn(2, rows, K).to(dtype)
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            got = layer(x)
        names = [event.name for event in profiled.events()]
        assert names.count("tgis::int8_linear") == 1 and "aten::round" not in names
        layer.q8_kernel = False
        want = layer(x)
        layer.q8_kernel = True
        assert got.shape == (2, rows, N) and got.dtype == dtype
        step = 1e-5 if dtype == torch.float32 else 1e-2  # a float32 or a bfloat16 rounding
        torch.testing.assert_close(got.float(), want.float(), atol=step * float(want.abs().max()), rtol=step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(weight, dtype, method) -> None:
    """A step's width changes nothing for a row: what speculation's exactness and a load-independent
    answer rest on. int4 in groups of 32 is torch's product; check_int4_kernel asserts the same of the
    kernels' (groups of a multiple of 64)."""
    layer = nn.Linear(K, N, bias=False).to(dtype)
    if method == "int8":
        install_int8(layer, *int8_per_channel(weight), dtype)
    else:
        install_int4(layer, int4_groupwise(weight, GROUP), dtype)
    x = torch.randn(21, K).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(layer(x), alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int4_product_is_the_dequantized_product_at_every_row_count(weight, dtype, rows) -> None:
    layer = Conv1D(N, K).to(dtype)  # GPT-2's [in, out] layout: quantized as [out, in]
    weights = int4_groupwise(weight, GROUP)
    install_int4(layer, weights, dtype)
    x = torch.randn(2, rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = x.float() @ dequantize_int4(weights).t() + layer.bias.float()
    # Of the largest output: 200 random inputs read at most 6e-7 in float32 and 6.1e-3 in bfloat16 (its
    # rounding); an element-wise 6e-2 failed one bfloat16 input in ten, where an output was near zero.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert relative(layer(x), expected) < tolerance


def test_int4_act_order_permutes_the_activations_as_the_checkpoint_did(weight) -> None:
    permutation = torch.randperm(K, generator=torch.Generator().manual_seed(1))
    grouped = int4_groupwise(weight[:, permutation], GROUP)  # the checkpoint's groups, in group order
    weights = type(grouped)(grouped.q, grouped.scale, grouped.zero, GROUP, permutation)
    layer = nn.Linear(K, N, bias=False)
    install_int4(layer, weights, torch.float32)
    x = torch.randn(5, K)
    torch.testing.assert_close(layer(x), x @ dequantize_int4(weights).t(), atol=1e-4, rtol=1e-4)


def _int4_kernel_expected(x: torch.Tensor, weights: Int4Weights) -> torch.Tensor:
    """What the kernels' int4 product stands for, in float64: each row quantized to int8 as int8 layers
    quantize theirs, times the 4-bit values a group at a time (integers), each group's scale and zero
    point applied to its integer sums."""
    # Quantized in float32 as the kernel does, 127 divided by the peak (a tensor's `127.0 / peak` is a
    # reciprocal times 127): otherwise a value that lands on .5 in one may not in the other.
    rows = x.reshape(-1, x.shape[-1]).float()
    peak = rows.abs().amax(1, keepdim=True).clamp(min=1e-12)
    xq = torch.round(rows * torch.full_like(peak, 127.0).div(peak)).clamp(-127, 127).double()
    peak = peak.double()
    n, k = weights.q.shape
    grouped = xq.view(len(rows), k // weights.group_size, weights.group_size)
    sums = torch.einsum("mgk,ngk->mng", grouped, weights.q.double().view(n, *grouped.shape[1:]))
    zero_part = weights.zero.double()[None] * grouped.sum(-1)[:, None, :]
    return ((sums - zero_part) * weights.scale.double()[None]).sum(-1) * (peak / 127)


KERNEL_N, KERNEL_K = 48, 384


@pytest.mark.parametrize("group", [64, 128, 192, 384])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_kernel_is_the_integer_product_of_int8_rows_and_each_group(group, dtype) -> None:
    """On a CPU with AVX-512 VNNI or AVX2, int4 layers whose groups are a multiple of 64 features are one
    kernel call (tgis::int4_linear) at every row count: exactly the formula above up to float32 (or the
    output's bfloat16) rounding, checked in float64; groups of 128 and their multiples take the kernel's
    128-value unit, 64 and 192 its 64-value unit. Elsewhere the layer keeps torch's int4 product."""
    check_int4_kernel(group, dtype)


def check_int4_kernel(group: int, dtype: torch.dtype) -> None:
    from torch.profiler import ProfilerActivity, profile

    weight = torch.randn(KERNEL_N, KERNEL_K, generator=torch.Generator().manual_seed(group))
    weights = int4_groupwise(weight, group)
    layer: Any = nn.Linear(KERNEL_K, KERNEL_N, bias=True).to(dtype)
    bias = layer.bias.detach().clone()
    install_int4(layer, weights, dtype)
    built = kernels()
    assert layer.q4_kernel == (built is not None and built.int4_rows)
    if built is None or not layer.q4_kernel:
        assert built is None or not (_has_vnni() or "avx2" in cpu_extensions().split())
        return
    assert layer.q4_nibbles.dim() == (3 if built.int4_tiles else 2)  # laid out for the AMX tiles if they run
    for rows in (1, 3, 4, 5, 17):
        x = torch.randn(2, rows, KERNEL_K).to(dtype)
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            got = layer(x)
        assert [event.name for event in profiled.events()].count("tgis::int4_linear") == 1
        want = _int4_kernel_expected(x, weights) + bias.double()
        step = 1e-5 if dtype == torch.float32 else 1e-2
        assert got.shape == (2, rows, KERNEL_N) and got.dtype == dtype
        torch.testing.assert_close(
            got.double().view(-1, KERNEL_N), want, atol=step * float(want.abs().max()), rtol=step
        )
    dense = x.double() @ dequantize_int4(weights).double().t() + bias.double()
    assert float((got.double() - dense).abs().max()) < 0.05 * float(dense.abs().max())  # int8 rows: near
    assert layer(x[0, :0]).shape == (0, KERNEL_N)
    # A row's result does not depend on the rows beside it: 40 rows are three blocks of rows on the tiles.
    x = torch.randn(40, KERNEL_K).to(dtype)
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(len(x))]))


def test_the_tiled_int4_layout_unpacks_into_the_tiles_the_product_reads() -> None:
    """pack_int4_tiles as cpu_products.cpp's unpack_tile reads it: 64 bytes of a block's 512 give two rows of
    the weight's tile (low nibbles, then high), and tile row i holds features 4i to 4i + 3 of each of the
    block's 16 outputs in turn. The scales come a block's group at a time."""
    n, k, groups = 32, 128, 2
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    packed = pack_int4_tiles(q)
    assert packed.shape == (n // 16, k // 64, 512) and packed.dtype == torch.uint8
    for block in range(n // 16):
        for depth in range(k // 64):
            pairs = packed[block, depth].view(8, 64)
            tile = torch.stack([pairs & 0x0F, pairs >> 4], dim=1).reshape(16, 64)
            for i in range(16):
                for output in range(16):
                    features = q[block * 16 + output, depth * 64 + 4 * i : depth * 64 + 4 * i + 4]
                    assert tile[i, output * 4 : output * 4 + 4].tolist() == features.tolist()
    scales = torch.randn(n, groups)
    tiled = tile_scales(scales)
    assert tiled.shape == (n // 16, groups, 16)
    assert torch.equal(tiled[1, 1], scales[16:32, 1])


def test_int4_outputs_that_do_not_fill_a_tile_keep_the_row_layout() -> None:
    """40 outputs (not a multiple of 16): the row kernel's layout, on every CPU with the kernels."""
    weights = int4_groupwise(torch.randn(40, KERNEL_K, generator=torch.Generator().manual_seed(7)), 128)
    layer: Any = nn.Linear(KERNEL_K, 40, bias=False)
    install_int4(layer, weights, torch.float32)
    if not layer.q4_kernel:
        pytest.skip("this CPU has no int4 kernel")
    assert layer.q4_nibbles.shape == (40, KERNEL_K // 2)
    x = torch.randn(5, KERNEL_K)
    torch.testing.assert_close(layer(x).double(), _int4_kernel_expected(x, weights), atol=1e-4, rtol=1e-4)


def _int4_layout(weights: Int4Weights, tiled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernel_int4_tensors(weights.q, weights.scale, weights.zero, weights.group_size, tiled)


def test_on_the_amx_tiles_both_int4_layouts_compute_the_formula() -> None:
    built = kernels()
    if built is None or not built.int4_tiles:
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    weights = int4_groupwise(torch.randn(KERNEL_N, KERNEL_K, generator=torch.Generator().manual_seed(8)), 128)
    x = torch.randn(33, KERNEL_K)
    for tiled in (False, True):
        got = torch.ops.tgis.int4_linear(x, *_int4_layout(weights, tiled), 128, None)
        torch.testing.assert_close(got.double(), _int4_kernel_expected(x, weights), atol=1e-4, rtol=1e-4)


def test_without_the_amx_tiles_the_tiled_layout_is_refused() -> None:
    built = kernels()
    if built is None or built.int4_tiles:
        pytest.skip("this CPU runs the tiled layout")
    weights = int4_groupwise(torch.randn(KERNEL_N, KERNEL_K, generator=torch.Generator().manual_seed(9)), 128)
    with pytest.raises(RuntimeError, match="needs AMX"):
        torch.ops.tgis.int4_linear(torch.randn(2, KERNEL_K), *_int4_layout(weights, tiled=True), 128, None)


_AVX2_BUILD = """
import torch
from engines.paged import cpu_kernel
cpu_kernel.TARGET_FLAGS = ["-march=x86-64-v3"]
torch.backends.cpu.get_cpu_capability = lambda: "AVX2"
built = cpu_kernel.kernels()
assert built is not None and built.int4_rows and built.int8_rows is None and not built.bf16_rows, built
from tests.unit.engines.test_quantized import check_int4_kernel
for group in (64, 128, 192, 384):
    for dtype in (torch.float32, torch.bfloat16):
        check_int4_kernel(group, dtype)
print("AVX2 int4 kernel checked")
"""


@pytest.mark.slow
def test_the_int4_kernels_avx2_path_computes_the_same(tmp_path) -> None:
    """The kernels built for an AVX2-only CPU (-march=x86-64-v3, no AVX-512), whatever CPU runs the test:
    their int4 product (16-bit pair sums widened to int32: the same integers as VNNI's) holds to the same
    formula. In a process of its own: a second build registers the same operators."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if "avx2" not in cpu_extensions().split():
        pytest.skip("this CPU cannot run an AVX2 build")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", _AVX2_BUILD], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "AVX2 int4 kernel checked" in done.stdout


def test_int4_groups_the_kernel_cannot_take_keep_torchs_product(monkeypatch) -> None:
    """Groups of 32 (not a multiple of 64), or a CPU without the kernel (simulated): torch's int4
    product on the dequantized weights' values, activations as they are."""
    from engines.paged import cpu_kernel

    weight = torch.randn(KERNEL_N, KERNEL_K, generator=torch.Generator().manual_seed(3))
    x = torch.randn(3, KERNEL_K)
    narrow = nn.Linear(KERNEL_K, KERNEL_N, bias=False)
    install_int4(narrow, int4_groupwise(weight, 32), torch.float32)
    built = kernels()
    if built is not None:
        monkeypatch.setattr(cpu_kernel, "kernels", lambda: dataclasses.replace(built, int4_rows=False))
    without_vnni = nn.Linear(KERNEL_K, KERNEL_N, bias=False)
    install_int4(without_vnni, int4_groupwise(weight, 128), torch.float32)
    for layer, group in ((narrow, 32), (without_vnni, 128)):
        assert not layer.q4_kernel
        expected = x @ dequantize_int4(int4_groupwise(weight, group)).t()
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_the_int4_kernel_permutes_act_order_activations() -> None:
    weight = torch.randn(KERNEL_N, KERNEL_K, generator=torch.Generator().manual_seed(4))
    permutation = torch.randperm(KERNEL_K, generator=torch.Generator().manual_seed(5))
    grouped = int4_groupwise(weight[:, permutation], 128)
    weights = Int4Weights(grouped.q, grouped.scale, grouped.zero, 128, permutation)
    layer: Any = nn.Linear(KERNEL_K, KERNEL_N, bias=False)
    install_int4(layer, weights, torch.float32)
    x = torch.randn(5, KERNEL_K)
    if layer.q4_kernel:
        expected = _int4_kernel_expected(x[:, permutation], grouped)
    else:  # torch's product: the dequantized weights, activations as they are
        expected = (x @ dequantize_int4(weights).t()).double()
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-4)


def test_int8_embedding_rows_are_their_values_times_their_scale(weight) -> None:
    embedding = nn.Embedding(N, K)
    q, scale = int8_per_channel(weight)
    install_int8_embedding(embedding, q, scale, torch.float32)
    ids = torch.tensor([[0, 5, 47], [3, 3, 1]])
    torch.testing.assert_close(embedding(ids), (q.float() * scale[:, None])[ids])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_model_keeps_its_modules_and_a_fraction_of_its_bytes(model_dirs, method) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32)
    head_before = model.get_output_embeddings()
    report = quantize_model(model, method, group_size=32)
    assert model.get_output_embeddings() is head_before  # modules stay: peft and the engine find them
    assert report.int8_layers + report.int4_layers == sum(1 for m in model.modules() if type(m) is nn.Linear)
    assert head_before.quantized == "int8"  # the head stays at 8 bits, as llama.cpp's files
    ratio = report.bytes_after / report.bytes_before
    assert ratio < (0.32 if method == "int8" else 0.24), ratio  # float32 weights: 1/4 and 1/8 plus scales
