"""The paged engine beyond its CPU attention: the ragged layout for CUDA's varlen kernel, and the hidden
states a speculator reads.

The kernel needs a CUDA build; here a pure-torch stand-in with the kernel's documented semantics
(queries aligned to the end of their keys, keys read through the block table up to seqused_k) takes
its place, so the layout and the call are checked against the CPU path's own attention on every
platform. The kernel itself is exercised by the GPU tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.base import EngineSpec
from engines.paged import attention as paged
from engines.paged import ragged
from engines.paged.engine import build
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size,
                     enable_gqa, seqused_k, block_table):  # fmt: skip
    """torch.nn.attention.varlen.varlen_attn with a block table, as documented, in plain torch."""
    assert cu_seq_k is None and block_table.dtype == torch.int32
    out = torch.empty_like(query)
    for i in range(len(seqused_k)):
        start, end = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        used = int(seqused_k[i])
        keys = key[block_table[i].long()].flatten(0, 1)[:used]
        values = value[block_table[i].long()].flatten(0, 1)[:used]
        q_pos = used - (end - start) + torch.arange(end - start)
        k_pos = torch.arange(used)
        mask = k_pos[None] <= q_pos[:, None]
        if window_size[0] >= 0:
            mask &= k_pos[None] >= q_pos[:, None] - window_size[0]
        attended = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out[start:end] = attended[0].transpose(0, 1)
    return out


@pytest.fixture
def stand_in(monkeypatch):
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen)


def test_the_layout_lays_chunks_end_to_end_with_their_blocks() -> None:
    step = ragged.layout([1, 5, 2], [9, 5, 14], [(3, 7, 1), (2, 4), (0, 5, 6, 8)], torch.device("cpu"))
    assert step.cu_seq_q.tolist() == [0, 1, 6, 8]
    assert step.seqused_k.tolist() == [9, 5, 14]
    assert step.block_table.tolist() == [[3, 7, 1, 0], [2, 4, 0, 0], [0, 5, 6, 8]]
    assert step.block_table.dtype == torch.int32 and (step.max_q, step.max_k) == (5, 14)


@pytest.mark.parametrize("window", [None, 3])
def test_one_call_equals_the_decode_and_prompt_paths(stand_in, window) -> None:
    generator = torch.Generator().manual_seed(0)
    key_cache = torch.randn(12, BLOCK, KV_HEADS, DIM, generator=generator)
    value_cache = torch.randn(12, BLOCK, KV_HEADS, DIM, generator=generator)
    # two decoding sequences (one token each) then a prompt chunk of 3 after 5 cached positions
    tables = [(2, 9, 4), (7,), (1, 3)]
    ends = [11, 3, 8]
    lengths = [1, 1, 3]
    query = torch.randn(sum(lengths), HEADS, DIM, generator=generator)
    scale = DIM**-0.5
    step = ragged.layout(lengths, ends, tables, torch.device("cpu"))
    got = ragged.attention(query, key_cache, value_cache, step, scale, window)

    decode_tables = torch.tensor([[2, 9, 4], [7, 0, 0]])
    decode = paged.decode_attention(
        query[:2], key_cache, value_cache, decode_tables, torch.tensor([11, 3]), scale, window
    )
    starts, lens, contexts = torch.tensor([0]), torch.tensor([3]), torch.tensor([5])
    prompt = paged.prefill_attention(
        query[2:], key_cache, value_cache, torch.tensor([[1, 3]]), starts, lens, contexts, scale, window
    )
    assert torch.allclose(got[:2], decode, atol=1e-5)
    assert torch.allclose(got[2:], prompt, atol=1e-5)


def test_the_kernel_is_only_offered_on_cuda() -> None:
    assert not ragged.available(torch.device("cpu"))


def test_a_step_through_the_kernel_equals_the_per_sequence_path(stand_in) -> None:
    """A whole model step with the engine's ragged layout (the kernel stood in for) gives the logits
    the per-sequence path gives."""
    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    engine = build(model, spec)
    engine.allocate(16, BLOCK)
    prompt = SequenceChunk(tuple(range(3, 12)), 0, (0, 1, 2), all_logits=True)
    decode = SequenceChunk((7,), 5, (4, 5), sample=True)
    warm = StepBatch(prefill=(SequenceChunk(tuple(range(20, 25)), 0, (4, 5), all_logits=True),))
    engine.step(warm)
    batch = StepBatch(decode=(decode,), prefill=(prompt,))
    plain = engine.step(batch)
    engine.ragged = True  # as allocate sets it on CUDA once the kernel passes its probe
    engine.step(warm)
    through_kernel = engine.step(batch)
    assert through_kernel.chunk_rows == plain.chunk_rows == [range(0, 1), range(1, 10)]  # decode, prompt
    assert torch.allclose(through_kernel.logits, plain.logits, atol=1e-4)


def test_the_probe_accepts_a_kernel_that_agrees_with_the_torch_path(stand_in, monkeypatch) -> None:
    monkeypatch.setattr(ragged, "available", lambda device: True)
    assert ragged.probe(4, KV_HEADS, HEADS, DIM, torch.float32, torch.device("cpu")) is None


def test_the_probe_refuses_a_kernel_that_fails_or_disagrees(monkeypatch) -> None:
    from torch.nn.attention import varlen

    monkeypatch.setattr(ragged, "available", lambda device: True)
    monkeypatch.setattr(
        varlen, "varlen_attn", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("page size"))
    )
    assert "page size" in (ragged.probe(4, KV_HEADS, HEADS, DIM, torch.float32, torch.device("cpu")) or "")
    monkeypatch.setattr(varlen, "varlen_attn", lambda query, *a, **k: torch.zeros_like(query))
    assert "deviates" in (ragged.probe(4, KV_HEADS, HEADS, DIM, torch.float32, torch.device("cpu")) or "")


def test_a_step_asked_for_hidden_states_returns_the_lm_heads_inputs() -> None:
    """What a speculator is fed: the rows the LM head turned into this step's logits."""
    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    engine = build(model, spec)
    engine.allocate(16, BLOCK)
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


def test_a_step_of_short_chunks_attends_every_token_through_the_cpu_kernel(monkeypatch) -> None:
    """Decode tokens, a short prompt and a draft-sized chunk over cached positions: through the CPU
    kernel (one query per token, its own length) the step gives the logits of the per-sequence path,
    and the caches hold the same keys."""
    from engines.paged import cpu_kernel

    kernel = cpu_kernel.decode_layer_kernel()
    if kernel is None:
        pytest.fail("the CPU kernel must build on the test machine")
    calls = []

    def counted(*args):
        calls.append(args[0].shape[2])  # the step's tokens
        return kernel(*args)

    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    warm = (
        SequenceChunk(tuple(range(20, 25)), 0, (4, 5), all_logits=True),
        SequenceChunk(tuple(range(30, 36)), 0, (6, 7, 8), all_logits=True),
    )
    batch = StepBatch(
        decode=(SequenceChunk((7,), 5, (4, 5), sample=True),),
        prefill=(
            SequenceChunk(tuple(range(3, 12)), 0, (0, 1, 2), all_logits=True),  # a short prompt
            SequenceChunk((40, 41, 42, 43), 6, (6, 7, 8), all_logits=True),  # a draft after 6 cached
        ),
    )
    engine = build(model, spec)
    engine.allocate(16, BLOCK)
    outputs = []
    for fused in (counted, None):  # the same slots rewritten with the same values: caches comparable
        monkeypatch.setattr(cpu_kernel, "decode_layer_kernel", lambda fused=fused: fused)
        engine.step(StepBatch(prefill=warm))
        outputs.append((engine.step(batch), [cache.clone() for cache in engine._key_caches]))
    (through_kernel, kernel_caches), (plain, plain_caches) = outputs
    layers = model.config.num_hidden_layers  # the warm-up's 11 tokens, then the step's 14, every layer
    assert calls == [5 + 6] * layers + [1 + 9 + 4] * layers
    assert through_kernel.chunk_rows == plain.chunk_rows
    assert torch.allclose(through_kernel.logits, plain.logits, atol=1e-4)
    assert torch.equal(kernel_caches[0], plain_caches[0])  # the first layer's keys: the same projection
    for got, expected in zip(kernel_caches[1:], plain_caches[1:], strict=True):  # after attention: rounding
        assert torch.allclose(got, expected, atol=1e-4)


def test_per_token_tables_give_each_token_its_sequences_blocks_and_length() -> None:
    from engines.paged import step_inputs

    def used(chunks):
        return [step_inputs.used_blocks(chunk, BLOCK) for chunk in chunks]

    chunks = [SequenceChunk((7,), 5, (4, 5)), SequenceChunk((1, 2, 3), 6, (6, 7, 8))]
    tables = step_inputs.per_token_tables(chunks, used(chunks), torch.device("cpu"))
    assert tables is not None
    assert tables[0].tolist() == [[4, 5, 0], [6, 7, 8], [6, 7, 8], [6, 7, 8]]  # padded with block 0
    assert tables[1].tolist() == [6, 7, 8, 9]
    long_prompt = SequenceChunk(tuple(range(step_inputs.PER_TOKEN_MAX_CHUNK + 1)), 0, (0, 1, 2, 3, 4))
    with_long = [*chunks, long_prompt]
    assert step_inputs.per_token_tables(with_long, used(with_long), torch.device("cpu")) is None
