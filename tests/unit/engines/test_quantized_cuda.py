"""The quantized layers' CUDA products (engines/quantized_cuda.py).

On the CPU: the padded int8 product gives the exact sums at every row count (torch._int_mm runs on
the CPU too), and the int4 layout and scales are what torch's int4 products take, checked by running
the probe through torch's CPU int4 kernel fed from the CUDA layout as documented; the probe refuses a
kernel that reads the nibbles the other way round.

Marked `gpu` (skipped without CUDA): on a CUDA device both kernels must pass their probes and serve the
layers (a run that fell back to dequantizing must not pass), and each layer gives its dequantized
weight's product, at one row and at many.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from engines import quantized_cuda
from engines.quantized import (
    dequantize_int4,
    install_int4,
    install_int8,
    int4_groupwise,
    int8_per_channel,
    quantize_model,
    torch_int4_scales,
)
from tests.fixtures.tiny import make_model, relative

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 30])
def test_padded_int8_sums_are_exact_at_every_row_count(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randint(-127, 128, (rows, 64), generator=generator, dtype=torch.int8)
    q = torch.randint(-127, 128, (24, 64), generator=generator, dtype=torch.int8)
    sums = quantized_cuda.int8_sums(x, q)
    assert sums.shape == (rows, 24)
    assert torch.equal(sums.long(), x.long() @ q.long().t())


def test_the_int8_probe_passes_where_int_mm_is_exact() -> None:
    assert quantized_cuda.int_mm_works(torch.device("cpu")) is None  # the CPU's torch._int_mm


@pytest.mark.parametrize(
    ("shape", "group", "tiles"),
    [
        ((64, 256), 128, 8),
        ((64, 192), 64, 4),
        ((64, 96), 32, 2),
        ((60, 256), 128, None),
        ((64, 256), 96, None),
    ],
)
def test_tinygemm_takes_groups_of_32_to_256_and_outputs_in_eights(shape, group, tiles) -> None:
    outputs, inputs = shape
    assert quantized_cuda.tinygemm_inner_k_tiles(outputs, inputs, group) == tiles


def test_nibbles_pack_even_features_high() -> None:
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]], dtype=torch.uint8)
    assert quantized_cuda.pack_nibbles(q).tolist() == [[0x12, 0x34], [0xF0, 0x78]]


def _cpu_tinygemm(monkeypatch: pytest.MonkeyPatch, even_high: bool = True) -> None:
    """tinygemm's two calls emulated by torch's CPU int4 kernel, unpacking the nibbles as the CUDA
    packing reads them (or, with `even_high` false, the other way round)."""

    def convert(packed: torch.Tensor, tiles: int) -> torch.Tensor:
        high, low = (packed >> 4).int(), (packed & 0x0F).int()
        even, odd = (high, low) if even_high else (low, high)
        values = torch.stack([even, odd], dim=2).view(packed.shape[0], -1)
        return torch._convert_weight_to_int4pack_for_cpu(values.contiguous(), 1)

    def product(rows: torch.Tensor, packed: torch.Tensor, group: int, scales: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, packed, group, scales)

    monkeypatch.setattr(torch, "_convert_weight_to_int4pack", convert)
    monkeypatch.setattr(torch, "_weight_int4pack_mm", product)


@pytest.mark.parametrize(("group", "tiles"), [(32, 2), (64, 4), (128, 8)])
def test_the_int4_probe_passes_the_documented_layout(monkeypatch, group, tiles) -> None:
    _cpu_tinygemm(monkeypatch)
    assert quantized_cuda.tinygemm_works.__wrapped__(torch.device("cpu"), group, tiles) is None


def test_the_int4_probe_refuses_nibbles_read_the_other_way(monkeypatch, caplog) -> None:
    _cpu_tinygemm(monkeypatch, even_high=False)
    reason = quantized_cuda.tinygemm_works.__wrapped__(torch.device("cpu"), 128, 8)
    assert reason is not None and "off the dequantized layer's" in reason
    assert "dequantize their weights per call" in caplog.text


def test_the_int4_probe_refuses_a_kernel_that_raises(monkeypatch) -> None:
    _cpu_tinygemm(monkeypatch)

    def older_gpu(*args: object) -> torch.Tensor:
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(torch, "_weight_int4pack_mm", older_gpu)
    reason = quantized_cuda.tinygemm_works.__wrapped__(torch.device("cpu"), 128, 8)
    assert reason == "tinygemm failed: CUDA error: no kernel image is available for execution on the device"


def test_a_tinygemm_weight_gives_the_dequantized_product(monkeypatch) -> None:
    """The layout and scales a layer gets on CUDA (`tinygemm_weight`'s packing), through the emulation."""
    _cpu_tinygemm(monkeypatch)
    weights = int4_groupwise(torch.randn(64, 256, generator=torch.Generator().manual_seed(1)), 64)
    assert quantized_cuda.tinygemm_weight(weights.q, torch_int4_scales(weights), 64) is None  # off CUDA
    tiles = quantized_cuda.tinygemm_inner_k_tiles(64, 256, 64)
    assert tiles is not None
    fast = quantized_cuda._tinygemm_weight(weights.q, torch_int4_scales(weights), tiles)
    rows = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    expected = rows.to(torch.bfloat16).float() @ dequantize_int4(weights).t()
    found = quantized_cuda.tinygemm_product(rows, fast.packed, 64, fast.scale_and_zero)
    assert relative(found, expected) < 2e-2


# ---- on a CUDA device ----------------------------------------------------------------------------------


def _cuda_layer(seed: int, outputs: int = 256, inputs: int = 512) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(inputs, outputs, bias=True).to("cuda", torch.bfloat16).eval()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_an_int8_layer_on_cuda_takes_cublaslt_and_gives_exact_sums(rows: int) -> None:
    layer = _cuda_layer(0)
    weight = layer.weight.detach().clone()
    q, scale = int8_per_channel(weight)
    install_int8(layer, q, scale, torch.bfloat16)
    assert quantized_cuda.int_mm_works(weight.device) is None, "cuBLASLt's int8 GEMM must serve here"
    x = torch.randn(rows, weight.shape[1], device="cuda", dtype=torch.bfloat16)
    found = layer(x)
    peak = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    quantized = torch.round(x.float() * (127.0 / peak)).clamp(-127, 127)
    exact = (quantized.double() @ q.double().t()).float() * (peak / 127.0) * scale.float()
    expected = exact + layer.bias.float()
    assert relative(found, expected) < 1e-2  # bfloat16 output; the sums themselves are exact


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("group", [32, 128])
def test_an_int4_layer_on_cuda_takes_tinygemm_and_gives_the_dequantized_product(rows, group) -> None:
    layer = _cuda_layer(1)
    weights = int4_groupwise(layer.weight.detach().float(), group)
    bias = layer.bias.detach().clone()
    install_int4(layer, weights, torch.bfloat16)
    assert layer.q4_tinygemm, "tinygemm must serve here"
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ dequantize_int4(weights).t() + bias.float()
    assert relative(layer(x), expected) < 3e-2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_model_on_cuda_computes_what_its_dequantizing_twin_does(monkeypatch, method) -> None:
    """The same tiny llama quantized twice on the GPU: through the kernels, and with both probes made to
    refuse, so that every layer dequantizes its weight per call. Same quantized weights, same logits."""

    def quantized(fast: bool) -> Any:
        if not fast:
            monkeypatch.setattr(quantized_cuda, "int_mm_works", lambda device: "refused for the test")
            monkeypatch.setattr(quantized_cuda, "tinygemm_works", lambda *args: "refused for the test")
        model: Any = make_model("llama")
        model.to("cuda", torch.bfloat16)
        quantize_model(model, method, group_size=32)
        return model

    fast, slow = quantized(True), quantized(False)
    layers = [m for m in fast.modules() if getattr(m, "quantized", None) in ("int8", "int4")]
    assert all(m.q4_tinygemm for m in layers if m.quantized == "int4")
    assert all(m.q8_cuda_int_mm for m in layers if m.quantized == "int8" and isinstance(m, nn.Linear))
    assert (method == "int4") == any(m.quantized == "int4" for m in layers)
    ids = torch.randint(0, fast.config.vocab_size, (2, 12), device="cuda")
    with torch.inference_mode():
        assert relative(fast(input_ids=ids).logits, slow(input_ids=ids).logits) < 3e-2
