"""oneDNN-packed linear layers (engines/cpu_prepack.py): same outputs, dense weights released (float32
ones kept once for the few-row product), tied output embeddings untouched, and peft's LoRA layers
still build around them; on a CPU without oneDNN kernels for the dtype (bfloat16 on AVX2-only x86),
plain layers and the reason logged."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from engines import cpu_prepack
from engines.cpu_prepack import can_prepack, packing_unsupported, prepack_linears
from engines.paged import cpu_kernel
from tests.fixtures.tiny import logits_side_by_side, make_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

# What torch raises for a bfloat16 weight where oneDNN has no bf16 kernels (e.g. AVX2-only x86).
NO_BF16_MESSAGE = (
    "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
    "avx512vl and avx512dq"
)


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """The support probe is cached per process: forget what it found before and after the test."""
    packing_unsupported.cache_clear()
    yield
    packing_unsupported.cache_clear()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "bloom", "t5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_model_computes_the_same_logits(arch: str, dtype: torch.dtype, caplog) -> None:
    """Packed where this CPU can pack the dtype, left plain where it cannot; the same logits either way."""
    torch.manual_seed(0)
    plain = make_model(arch).to(dtype).eval()  # type: ignore[arg-type]
    packed = copy.deepcopy(plain)
    with caplog.at_level(logging.INFO, logger="engines.cpu_prepack"):
        count = prepack_linears(packed, min_bytes=0)
    reason = packing_unsupported(dtype)
    linears = [m for m in plain.modules() if type(m) in (torch.nn.Linear, Conv1D)]
    head = plain.get_output_embeddings()
    tied = head.weight is plain.get_input_embeddings().weight
    packable = len(linears) - (tied and head in linears)
    assert count == (packable if reason is None else 0)
    if reason is not None:
        assert f"Linear layers run unpacked: {reason}" in caplog.text
    want, got = logits_side_by_side(plain, packed)
    assert (got - want).abs().max() <= TOLERANCE[dtype] * want.abs().max()


def test_the_probe_agrees_with_torchs_own_cpu_check(fresh_probe) -> None:
    """float32 packs on any x86 CPU; bfloat16 exactly where torch's oneDNN bf16 check passes (it is
    what raises in the packing op), whichever kind of CPU runs the tests."""
    assert packing_unsupported(torch.float32) is None
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (packing_unsupported(torch.bfloat16) is None) == supported


def test_a_cpu_without_onednn_bf16_leaves_bf16_models_plain(monkeypatch, caplog, fresh_probe) -> None:
    """The packing op raising as torch does on an AVX2-only CPU: the bf16 model loads unpacked, computes
    exactly what the plain one does, and the log names the missing CPU support; float32 still packs."""
    real_reorder = torch.ops.mkldnn._reorder_linear_weight

    def reorder_without_bf16(weight: torch.Tensor, *args: object) -> torch.Tensor:
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(NO_BF16_MESSAGE)
        return real_reorder(weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder_without_bf16)
    torch.manual_seed(0)
    plain = make_model("llama").to(torch.bfloat16).eval()  # type: ignore[arg-type]
    model = copy.deepcopy(plain)
    with caplog.at_level(logging.INFO, logger="engines.cpu_prepack"):
        assert prepack_linears(model, min_bytes=0) == 0
    assert not any(hasattr(m, "packed_weight") for m in model.modules())
    assert all(m.weight.stride() != (0, 0) for m in model.modules() if isinstance(m, torch.nn.Linear))
    want, got = logits_side_by_side(plain, model)
    assert torch.equal(got, want)
    unpacked = [r.getMessage() for r in caplog.records if "run unpacked" in r.getMessage()]
    reason = f"oneDNN cannot pack torch.bfloat16 weights on this CPU ({NO_BF16_MESSAGE})"
    assert unpacked == [f"Linear layers run unpacked: {reason}"]
    assert prepack_linears(make_model("llama").eval(), min_bytes=0) > 0  # float32 is not affected


def test_dense_weights_are_released_and_tied_output_embeddings_kept() -> None:
    """Packed layers' weight parameters hold no values: a float32 layer keeps its one dense copy, as
    [outputs, inputs], for the few-row product, a bfloat16 one only where the CPU has AVX512_BF16;
    output embeddings tied to the input ones stay dense (the lookup reads them), and untied ones are
    packed like any linear layer, with the same logits."""
    torch.manual_seed(0)
    tied = make_model("gpt2").eval()
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    head = tied.get_output_embeddings().weight.detach().clone()
    attention_weight = tied.transformer.h[0].attn.c_attn.weight.detach().clone()
    prepack_linears(tied, min_bytes=0)
    attention = tied.transformer.h[0].attn.c_attn
    assert attention.weight.shape == (tied.config.n_embd, 3 * tied.config.n_embd)
    assert attention.weight.stride() == (0, 0)  # the parameter holds no values
    assert torch.equal(attention.few_rows_weight, attention_weight.t())  # Conv1D's [inputs, outputs]
    assert attention.few_rows_weight.is_contiguous()
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert torch.equal(tied.get_output_embeddings().weight, head)
    assert not hasattr(tied.get_output_embeddings(), "packed_weight")
    plain = make_model("gpt2").eval()  # untied in the fixture
    untied = copy.deepcopy(plain)
    prepack_linears(untied, min_bytes=0)
    assert hasattr(untied.get_output_embeddings(), "packed_weight")
    assert untied.get_output_embeddings().weight.stride() == (0, 0)
    assert untied.get_input_embeddings().weight.stride() != (0, 0)
    want, got = logits_side_by_side(plain, untied)
    assert (got - want).abs().max() <= TOLERANCE[torch.float32] * want.abs().max()
    if packing_unsupported(torch.bfloat16) is None:
        bf16 = make_model("gpt2").to(torch.bfloat16).eval()  # type: ignore[arg-type]
        bf16_attention = bf16.transformer.h[0].attn.c_attn.weight.detach().clone()
        prepack_linears(bf16, min_bytes=0)
        copy_kept = bf16.transformer.h[0].attn.c_attn.few_rows_weight
        built = cpu_kernel.kernels()
        assert built is not None
        if built.bf16_rows and not cpu_prepack.amx_tiles():  # the product multiplies bfloat16 as it is
            assert copy_kept is not None and torch.equal(copy_kept, bf16_attention.t())
        else:
            assert copy_kept is None


@pytest.mark.parametrize("amx", [True, False])
def test_bfloat16_layers_keep_onednn_alone_on_a_cpu_with_amx(monkeypatch, amx: bool) -> None:
    """oneDNN multiplies bfloat16 in AMX tiles faster than the few-row product at every row count
    measured: there a packed bfloat16 layer keeps no dense copy and takes no few rows. Elsewhere with
    AVX512_BF16 it keeps both. The CPU's answer is replaced both ways, so every CPU checks both rules."""
    if packing_unsupported(torch.bfloat16) is not None:
        pytest.skip("oneDNN packs no bfloat16 on this CPU")
    built = cpu_kernel.kernels()
    assert built is not None
    monkeypatch.setattr(cpu_prepack, "amx_tiles", lambda: amx)
    model = make_model("llama").to(torch.bfloat16).eval()  # type: ignore[arg-type]
    assert prepack_linears(model, min_bytes=0) > 0
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    keeps = built.bf16_rows and not amx
    assert all((m.few_rows_weight is not None) == keeps for m in layers)
    assert {m.few_rows for m in layers} == {cpu_prepack.BF16_KERNEL_ROWS if keeps else 0}


def test_weights_under_the_size_threshold_stay_dense(caplog) -> None:
    """oneDNN's fixed cost per call outweighs packing on small weights: those keep F.linear, larger ones
    are packed, with the same outputs; `packing_every_size` packs them all."""
    from engines.cpu_prepack import PACK_MIN_BYTES, packing_every_size

    torch.manual_seed(0)
    width = int((PACK_MIN_BYTES // 4) ** 0.5)  # a float32 width x width weight of PACK_MIN_BYTES
    plain = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Linear(width, 8), Conv1D(8, 8), torch.nn.Linear(8, width)
    ).eval()
    model = copy.deepcopy(plain)
    with caplog.at_level(logging.INFO, logger="engines.cpu_prepack"):
        assert prepack_linears(model) == 1
    assert [hasattr(m, "packed_weight") for m in model] == [True, False, False, False]
    assert f"Packed 1 linear layers for oneDNN; 3 under {PACK_MIN_BYTES} bytes stay dense" in caplog.text
    x = torch.randn(3, width)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
    everything = copy.deepcopy(plain)
    with packing_every_size():
        assert prepack_linears(everything) == 4
    assert prepack_linears(copy.deepcopy(plain)) == 1  # the threshold is back after the block


def test_lora_layers_build_around_packed_layers() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    plain = make_model("llama").eval()
    packed = copy.deepcopy(plain)
    prepack_linears(packed, min_bytes=0)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ids = torch.randint(0, plain.config.vocab_size, (1, 7))
    outputs = []
    for model in (plain, packed):
        torch.manual_seed(1)  # the same random LoRA weights in both
        inject_adapter_in_model(config, model)
        with torch.inference_mode():
            outputs.append(model(input_ids=ids).logits)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5, rtol=1e-4)


def test_models_that_cannot_be_packed_are_left_alone() -> None:
    model = make_model("llama").half().eval()
    assert can_prepack(model) is not None
    assert prepack_linears(model, min_bytes=0) == 0
    assert all(m.weight.stride() != (0, 0) for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_the_memory_mapped_checkpoint_is_released(tmp_path) -> None:
    """Loaded in its own dtype, a checkpoint's tensors are views of the mapped file; after packing
    none remain, so the file's pages are not held beside the packed copies."""
    import gc
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    make_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    checkpoint = str(tmp_path / "model.safetensors")
    maps = Path("/proc/self/maps")
    if not maps.exists() or checkpoint not in maps.read_text():
        pytest.skip("transformers did not memory-map the checkpoint here")
    prepack_linears(model, min_bytes=0)
    gc.collect()
    assert checkpoint not in maps.read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("outputs", "dim"), [(1000, 64), (997, 20), (61, 7), (3, 9)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_few_row_product_is_a_linear(dtype: torch.dtype, outputs: int, dim: int, with_bias: bool) -> None:
    """cpu_products.cpp's few_rows_linear against F.linear, for leading dimensions of any shape, odd and
    even row counts, output counts off the tile of four and widths off the vector width."""
    from engines.paged import cpu_kernel

    kernel = cpu_kernel.few_rows_linear_kernel()
    if kernel is None:
        pytest.fail("the CPU kernel must build on the test machine")
    generator = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, dim, generator=generator).to(dtype)
    bias = torch.randn(outputs, generator=generator).to(dtype) if with_bias else None
    for shape in [(dim,), (1, 1, dim), (3, dim), (2, 4, dim), (17, dim)]:
        x = torch.randn(shape, generator=generator).to(dtype)
        got = kernel(x, weight, bias)
        want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        assert got.shape == (*shape[:-1], outputs) and got.dtype == dtype
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, atol=tolerance * dim**0.5, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [80, 96, 128])
def test_the_few_row_product_reads_aligned_and_unaligned_weights_alike(dtype: torch.dtype, dim: int) -> None:
    """A weight whose rows start 64-byte aligned is read by non-temporal loads on AVX-512 (bfloat16 with
    AVX512_BF16 at any row count, float32 in its own order for one or two rows), any other by ordinary
    ones: both give F.linear's values, and in bfloat16 (one order both ways) the same bits. 80 leaves a
    tail after the aligned chunks (16 float32 values; in bfloat16 its rows are not aligned at all); the
    unaligned copy starts one element into its buffer."""
    kernel = cpu_kernel.few_rows_linear_kernel()
    if kernel is None:
        pytest.fail("the CPU kernel must build on the test machine")
    generator = torch.Generator().manual_seed(dim)
    aligned = torch.randn(37, dim, generator=generator).to(dtype)
    buffer = torch.empty(aligned.numel() + 1, dtype=dtype)
    unaligned = buffer[1:].view(aligned.shape)
    unaligned.copy_(aligned)
    assert aligned.data_ptr() % 64 == 0 and unaligned.data_ptr() % 64 != 0
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for rows in (1, 2, 3):
        x = torch.randn(rows, dim, generator=generator).to(dtype)
        want = torch.nn.functional.linear(x.float(), aligned.float())
        got, got_unaligned = kernel(x, aligned, None), kernel(x, unaligned, None)
        for result in (got, got_unaligned):
            torch.testing.assert_close(result.float(), want, atol=tolerance * dim**0.5, rtol=tolerance)
        if dtype == torch.bfloat16:
            assert torch.equal(got, got_unaligned)


def test_the_few_row_product_refuses_mismatched_inputs() -> None:
    from engines.paged import cpu_kernel

    kernel = cpu_kernel.few_rows_linear_kernel()
    assert kernel is not None
    x, weight = torch.randn(2, 8), torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="last dimension"):
        kernel(torch.randn(2, 7), weight, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel(x.double(), weight, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(x, torch.randn(8, 5).t(), None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(x, weight, torch.randn(4))


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", torch.float32), ("gpt2", torch.float32), ("llama", torch.bfloat16)]
)
def test_packed_layers_take_the_few_row_product_up_to_their_rows(arch: str, dtype: torch.dtype) -> None:
    """Up to KERNEL_ROWS rows a packed float32 layer computes through the few-row product, more through
    oneDNN's packed weight (the operators torch's profiler saw); a bfloat16 one up to BF16_KERNEL_ROWS
    where the CPU multiplies bfloat16 natively, else always through oneDNN. The logits are the unpacked
    model's either way, within the dtype's rounding (nn.Linear and Conv1D)."""
    from torch.profiler import ProfilerActivity, profile

    if packing_unsupported(dtype) is not None:
        pytest.skip(f"oneDNN packs no {dtype} on this CPU")
    built = cpu_kernel.kernels()
    assert built is not None
    torch.manual_seed(0)
    plain = make_model(arch).to(dtype).eval()  # type: ignore[arg-type]
    model = copy.deepcopy(plain)
    packed = prepack_linears(model, min_bytes=0)
    rows = cpu_prepack.KERNEL_ROWS if dtype == torch.float32 else cpu_prepack.BF16_KERNEL_ROWS
    few_rows = rows if dtype == torch.float32 or (built.bf16_rows and not cpu_prepack.amx_tiles()) else 0
    for length in (1, rows, rows + 1):
        ids = torch.randint(3, plain.config.vocab_size, (1, length))
        with torch.inference_mode():
            want = plain(input_ids=ids).logits.float()
            with profile(activities=[ProfilerActivity.CPU]) as profiled:
                got = model(input_ids=ids).logits.float()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        else:
            assert (got - want).abs().max() <= TOLERANCE[dtype] * want.abs().max()
        names = [event.name for event in profiled.events()]
        few, onednn = names.count("tgis::few_rows_linear"), names.count("mkldnn::_linear_pointwise")
        # every packed layer (an untied head among them) ran one or the other
        assert (few, onednn) == ((packed, 0) if length <= few_rows else (0, packed))


def test_a_tied_head_takes_the_few_row_product_for_a_few_rows(monkeypatch) -> None:
    """Up to KERNEL_ROWS rows through the kernel, more through F.linear; the same logits as the
    unpacked model's either way."""

    torch.manual_seed(0)
    plain = make_model("gpt2").eval()
    plain.config.tie_word_embeddings = True
    plain.tie_weights()
    model = copy.deepcopy(plain)
    prepack_linears(model, min_bytes=0)
    real = cpu_kernel.few_rows_linear_kernel()
    assert real is not None
    calls: list[int] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_kernel, "few_rows_linear_kernel", lambda: counted)
    rows = cpu_prepack.KERNEL_ROWS
    for length in (1, rows, rows + 1):
        ids = torch.randint(3, plain.config.vocab_size, (1, length))
        with torch.inference_mode():
            want, got = plain(input_ids=ids).logits, model(input_ids=ids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert calls == [1, rows]  # rows + 1 went through F.linear


def test_dense_copies_are_not_kept_where_they_would_crowd_the_memory(monkeypatch, caplog) -> None:
    """The few-row product's dense copies take at most half the memory the OS reports available; past
    that, the float32 layers keep oneDNN alone, the log says why, and the outputs are the same."""
    torch.manual_seed(0)
    plain = make_model("llama").eval()

    def pack(available: int | None) -> tuple[torch.nn.Module, list[torch.Tensor | None]]:
        monkeypatch.setattr(cpu_prepack, "available_memory_bytes", lambda: available)
        model = copy.deepcopy(plain)
        assert prepack_linears(model, min_bytes=0) > 0
        return model, [m.few_rows_weight for m in model.modules() if hasattr(m, "packed_weight")]

    _, unknown = pack(None)  # no /proc/meminfo: kept
    copies = sum(w.numel() * w.element_size() for w in unknown if w is not None)
    assert copies > 0 and all(w is not None for w in unknown)
    assert all(w is not None for w in pack(2 * copies)[1])
    with caplog.at_level(logging.INFO, logger="engines.cpu_prepack"):
        tight, weights = pack(2 * copies - 1)
    assert all(w is None for w in weights)
    assert "no dense copies for the few-row product" in caplog.text
    want, got = logits_side_by_side(plain, tight)
    assert (got - want).abs().max() <= TOLERANCE[torch.float32] * want.abs().max()
