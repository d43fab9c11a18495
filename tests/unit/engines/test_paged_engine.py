"""The paged engine beyond its CPU attention: the varlen layouts CUDA's kernel reads (in place or
gathered), the hidden states a speculator reads, and the CPU kernel's fused steps.

The kernel needs a CUDA build; here its torch stand-in (engines.paged.varlen.reference_varlen, the
kernel's documented semantics: queries aligned to the end of their keys) takes its place, so the
layouts and the whole CUDA step are checked against the per-sequence path and transformers on every
platform. The kernel itself is exercised by the GPU tests."""

from __future__ import annotations

import pytest
import torch

from engines.base import EngineSpec
from engines.paged import attention as paged
from engines.paged import paths, ragged, self_test, step_context, varlen
from engines.paged.engine import build
from engines.paged.staging import Staging
from engines.paged.step_context import AttentionPath
from engines.quantized import install_int8, int8_per_channel
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8
CPU = torch.device("cpu")
VARLEN_PATHS = [AttentionPath.VARLEN_PAGED, AttentionPath.VARLEN_GATHERED]


def cpu_engine(path: AttentionPath | None = None, block_size: int = BLOCK, blocks: int = 32):
    """The tiny llama's paged engine on the CPU, serving through `path` (the varlen ones with the
    kernel's torch stand-in)."""
    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, CPU, torch.float32, paged=True)
    engine = build(model, spec, block_size)
    if path is not None:
        engine.use_attention(paths.AttentionChoice(path, block_size, varlen.reference_varlen))
    engine.allocate(blocks, block_size)
    return engine, model


def layout_of(path: AttentionPath, batch: StepBatch, caches: torch.Tensor) -> ragged.RaggedLayout:
    builder = step_context.StepBuilder(
        path,
        caches.shape[1],
        [caches],
        [caches],
        Staging(CPU),
        varlen.reference_varlen,
        lambda positions: ragged.Workspace.empty(positions, caches),
    )
    layout = step_context.build(batch, builder).context.ragged
    assert layout is not None
    return layout


MIXED = StepBatch(
    decode=(SequenceChunk((1,), 8, (3, 7, 1), sample=True),),
    prefill=(
        SequenceChunk((1, 2, 3, 4, 5), 0, (2, 4)),
        SequenceChunk((1, 2), 12, (0, 5, 6, 8)),
    ),
)


def test_the_paged_layout_lays_chunks_end_to_end_with_their_blocks() -> None:
    step = layout_of(AttentionPath.VARLEN_PAGED, MIXED, torch.zeros(10, BLOCK, KV_HEADS, DIM))
    assert step.cu_seq_q.tolist() == [0, 1, 6, 8]
    assert step.seqused_k is not None and step.seqused_k.tolist() == [9, 5, 14]
    assert step.block_table.tolist() == [[3, 7, 1, 0], [2, 4, 0, 0], [0, 5, 6, 8]]
    assert step.block_table.dtype == step.cu_seq_q.dtype == torch.int32
    assert (step.max_q, step.max_k, step.causal, step.gather) == (5, 14, True, None)


def test_the_gathered_layout_packs_every_sequences_positions_in_order() -> None:
    step = layout_of(AttentionPath.VARLEN_GATHERED, MIXED, torch.zeros(10, BLOCK, KV_HEADS, DIM))
    assert step.cu_seq_k is not None and step.cu_seq_k.tolist() == [0, 9, 14, 28]
    assert step.gather is not None and step.workspace is not None
    slots = [3 * 4 + p for p in range(4)] + [7 * 4 + p for p in range(4)] + [1 * 4]
    slots += [2 * 4 + p for p in range(4)] + [4 * 4]
    slots += [b * 4 + p for b in (0, 5, 6) for p in range(4)] + [8 * 4, 8 * 4 + 1]
    assert step.gather.tolist() == slots
    assert step.workspace.positions >= 28 and step.seqused_k is None


def test_a_decode_only_step_is_not_causal_so_the_kernel_can_pack_grouped_heads() -> None:
    decode = StepBatch(decode=MIXED.decode * 2)
    for path in VARLEN_PATHS:
        step = layout_of(path, decode, torch.zeros(10, BLOCK, KV_HEADS, DIM))
        assert (step.max_q, step.causal) == (1, False)


def test_rows_past_the_last_sequence_gather_the_scratch_slot() -> None:
    tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    slots = ragged.gather_slots(
        torch.tensor([0, 5, 7], dtype=torch.int32), tables, BLOCK, 10, scratch_slot=99
    )
    assert slots.tolist() == [12, 13, 14, 15, 4, 8, 9, 99, 99, 99]


@pytest.mark.parametrize("path", VARLEN_PATHS)
@pytest.mark.parametrize("window", [None, 3])
def test_one_call_equals_the_decode_and_prompt_paths(path, window) -> None:
    generator = torch.Generator().manual_seed(0)
    key_cache = torch.randn(12, BLOCK, KV_HEADS, DIM, generator=generator)
    value_cache = torch.randn(12, BLOCK, KV_HEADS, DIM, generator=generator)
    # two decoding sequences (one token each) then a prompt chunk of 3 after 5 cached positions
    batch = StepBatch(
        decode=(SequenceChunk((1,), 10, (2, 9, 4), sample=True), SequenceChunk((1,), 2, (7,), sample=True)),
        prefill=(SequenceChunk((1, 2, 3), 5, (1, 3)),),
    )
    query = torch.randn(5, HEADS, DIM, generator=generator)
    scale = DIM**-0.5
    step = layout_of(path, batch, key_cache)
    step = ragged.RaggedLayout(**{**vars(step), "workspace": ragged.Workspace.empty(64, key_cache)})
    got = ragged.attention(query, key_cache, value_cache, step, scale, window)

    decode_tables = torch.tensor([[2, 9, 4], [7, 0, 0]])
    decode = paged.decode_attention(
        query[:2], key_cache, value_cache, decode_tables, torch.tensor([11, 3]), scale, window
    )
    prompt = paged.prefill_attention(
        query[2:], key_cache, value_cache, torch.tensor([[1, 3]]), [0], [3], [5], scale, window
    )
    assert torch.allclose(got[:2], decode, atol=1e-5)
    assert torch.allclose(got[2:], prompt, atol=1e-5)


def test_no_varlen_kernel_is_offered_off_cuda() -> None:
    assert varlen.offer(CPU) == varlen.NONE


def test_the_offer_is_read_from_the_operators_schema(monkeypatch) -> None:
    """torch 2.11's schema has no block table (gathered keys only); 2.13's has one."""
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    before_213 = frozenset(
        {"query", "cum_seq_k", "seqused_k", "alibi_slopes", "window_size_left", "window_size_right"}
    )
    monkeypatch.setattr(varlen, "schema_arguments", lambda: before_213)
    assert varlen.offer(torch.device("cuda")) == varlen.Offer(varlen=True, paged=False, window=True)
    monkeypatch.setattr(varlen, "schema_arguments", lambda: before_213 | {"block_table"})
    assert varlen.offer(torch.device("cuda")).paged
    assert {"cum_seq_k", "block_table"} <= varlen.schema_arguments()  # this torch: 2.13


GEOMETRY = paths.Geometry(HEADS, KV_HEADS, DIM, torch.bfloat16, windowed=False)


def fake_cuda(monkeypatch, offer: varlen.Offer, accepts) -> None:
    """A CUDA device whose kernel `offer`s this, and whose probe passes where `accepts(path, size)`."""
    monkeypatch.setattr(varlen, "offer", lambda device: offer)
    monkeypatch.setattr(
        paths, "probe", lambda path, size, geometry, device: None if accepts(path, size) else "refused"
    )


def test_without_a_block_table_cuda_gathers_at_the_default_block_size(monkeypatch) -> None:
    fake_cuda(monkeypatch, varlen.Offer(True, paged=False, window=True), lambda path, size: True)
    choice = paths.choose(torch.device("cuda"), GEOMETRY, None)
    assert (choice.path, choice.block_size) == (AttentionPath.VARLEN_GATHERED, 16)
    assert choice.fallback is not None and "no block table" in choice.fallback


def test_with_a_block_table_the_auto_block_size_is_the_first_the_kernel_takes(monkeypatch) -> None:
    offer = varlen.Offer(True, paged=True, window=True)
    fake_cuda(monkeypatch, offer, lambda path, size: path is AttentionPath.VARLEN_GATHERED or size % 256 == 0)
    choice = paths.choose(torch.device("cuda"), GEOMETRY, None)
    assert (choice.path, choice.block_size, choice.fallback) == (AttentionPath.VARLEN_PAGED, 256, None)
    chosen = paths.choose(torch.device("cuda"), GEOMETRY, 16)  # KV_BLOCK_SIZE=16: gathered, with the reason
    assert (chosen.path, chosen.block_size) == (AttentionPath.VARLEN_GATHERED, 16)
    assert chosen.fallback is not None and "blocks of 16" in chosen.fallback


def test_a_kernel_that_fails_every_probe_leaves_torch_alone_with_the_reasons(monkeypatch) -> None:
    fake_cuda(monkeypatch, varlen.Offer(True, paged=True, window=True), lambda path, size: False)
    choice = paths.choose(torch.device("cuda"), GEOMETRY, None)
    assert choice.path is AttentionPath.PER_SEQUENCE and choice.fallback is not None
    assert "blocks of 256" in choice.fallback and "gathered" in choice.fallback
    windowed = paths.Geometry(HEADS, KV_HEADS, DIM, torch.bfloat16, windowed=True)
    fake_cuda(monkeypatch, varlen.Offer(True, paged=True, window=False), lambda path, size: True)
    assert paths.choose(torch.device("cuda"), windowed, 16).path is AttentionPath.PER_SEQUENCE


@pytest.mark.parametrize("path", VARLEN_PATHS)
def test_the_probe_accepts_a_kernel_that_agrees_with_its_stand_in(monkeypatch, path) -> None:
    monkeypatch.setattr(varlen, "flash_varlen", varlen.reference_varlen)
    geometry = paths.Geometry(HEADS, KV_HEADS, DIM, torch.float32, windowed=True)
    assert paths.probe(path, BLOCK, geometry, CPU) is None


def test_the_probe_refuses_a_kernel_that_fails_or_disagrees(monkeypatch) -> None:
    def refuses(*args, **kwargs):
        raise RuntimeError("Paged KV cache block size must be divisible by 256")

    monkeypatch.setattr(varlen, "flash_varlen", refuses)
    assert "divisible by 256" in (paths.probe(AttentionPath.VARLEN_PAGED, 16, GEOMETRY, CPU) or "")
    monkeypatch.setattr(varlen, "flash_varlen", lambda query, *args, **kwargs: torch.zeros_like(query))
    assert "deviates" in (paths.probe(AttentionPath.VARLEN_GATHERED, 16, GEOMETRY, CPU) or "")


@pytest.mark.parametrize("path", VARLEN_PATHS)
def test_a_step_through_the_kernel_equals_the_per_sequence_path_and_transformers(path) -> None:
    """A whole model step laid out for the kernel (the kernel stood in for) gives the logits the
    per-sequence path gives, and those of transformers' own forward."""
    engine, _ = cpu_engine(AttentionPath.PER_SEQUENCE)
    model = make_model("llama")  # the same weights, with transformers' own attention
    prompt = SequenceChunk(tuple(range(3, 12)), 0, (0, 1, 2), all_logits=True)
    decode = SequenceChunk((7,), 5, (4, 5), sample=True)
    warm = StepBatch(prefill=(SequenceChunk(tuple(range(20, 25)), 0, (4, 5), all_logits=True),))
    engine.step(warm)
    batch = StepBatch(decode=(decode,), prefill=(prompt,))
    plain = engine.step(batch)
    engine.use_attention(paths.AttentionChoice(path, BLOCK, varlen.reference_varlen))
    engine.step(warm)
    through_kernel = engine.step(batch)
    assert through_kernel.chunk_rows == plain.chunk_rows == [range(0, 1), range(1, 10)]  # decode, prompt
    assert torch.allclose(through_kernel.logits, plain.logits, atol=1e-4)
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([[*range(20, 25), 7]]), use_cache=False).logits[0, -1]
        alone = model(input_ids=torch.tensor([list(range(3, 12))]), use_cache=False).logits[0]
    assert torch.allclose(through_kernel.logits[0], full, atol=1e-4)
    assert torch.allclose(through_kernel.logits[1:], alone, atol=1e-4)


def test_a_varlen_path_that_fails_the_self_test_leaves_torch_serving_with_a_warning(
    monkeypatch, caplog
) -> None:
    broken = paths.AttentionChoice(
        AttentionPath.VARLEN_GATHERED, BLOCK, lambda query, *args, **kwargs: torch.zeros_like(query)
    )
    monkeypatch.setattr(paths, "choose", lambda device, geometry, block_size: broken)
    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, CPU, torch.float32, paged=True)
    with caplog.at_level("WARNING"):
        engine = build(model, spec, BLOCK)
    assert engine.attention.path is AttentionPath.PER_SEQUENCE
    assert "varlen_gathered path failed the self-test" in caplog.text


def test_a_step_asked_for_hidden_states_returns_the_lm_heads_inputs() -> None:
    """What a speculator is fed: the rows the LM head turned into this step's logits."""
    engine, model = cpu_engine(blocks=16)
    prompt = SequenceChunk(tuple(range(3, 12)), 0, (0, 1, 2), all_logits=True)
    decode = SequenceChunk((7,), 5, (4, 5), sample=True)
    engine.step(StepBatch(prefill=(SequenceChunk(tuple(range(20, 25)), 0, (4, 5), all_logits=True),)))
    out = engine.step(StepBatch(decode=(decode,), prefill=(prompt,), hidden=True))
    head = model.get_output_embeddings()
    assert out.hidden is not None
    assert out.chunk_rows == [range(0, 1), range(1, 1 + len(prompt.token_ids))]  # decode, prompt
    assert out.hidden.shape[0] == out.logits.shape[0] == 1 + len(prompt.token_ids)
    with torch.inference_mode():
        assert torch.allclose(head(out.hidden).float(), out.logits, atol=1e-5)
    assert engine.step(StepBatch(decode=(decode,))).hidden is None  # only when asked


@pytest.mark.parametrize(
    ("quantized", "deviation", "passes"), [(False, 0.0086, False), (True, 0.0086, True), (True, 0.1, False)]
)
def test_the_self_test_allows_a_quantized_model_one_activation_level(
    monkeypatch, quantized, deviation, passes
) -> None:
    """A float32 model's paged logits must match its own attention's to 1e-3; a quantized one's may move
    by an int8 activation's rounding level (about 1/127, seen as 0.0086 in CI), but not by what a wrong
    attention gives."""
    engine, model = cpu_engine()
    if quantized:
        layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        install_int8(layer, *int8_per_channel(layer.weight.detach()), torch.float32)
    monkeypatch.setattr(self_test, "run", lambda *_args: deviation)
    reason = self_test.failure(engine, model, engine.spec, "sdpa")
    assert (reason is None) == passes
    if not passes:
        assert reason == (
            f"the paged step's logits deviate by {deviation:.2g} of their magnitude "
            f"(tolerance {self_test.QUANTIZED_TOLERANCE if quantized else 1e-3})"
        )
