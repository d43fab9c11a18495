"""The paged step on the CPU with its kernels built: every token of a step of short chunks through the
fused decode layer (one call per layer), and the per-token tables it reads."""

from __future__ import annotations

import pytest
import torch

from engines.base import EngineSpec
from engines.paged.engine import build
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

BLOCK = 4


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
    engine = build(model, spec, BLOCK)
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
    tables = step_inputs.per_token_tables(chunks, used(chunks))
    assert tables is not None
    assert tables[0] == [[4, 5, 0], [6, 7, 8], [6, 7, 8], [6, 7, 8]]  # padded with block 0
    assert tables[1] == [6, 7, 8, 9]
    long_prompt = SequenceChunk(tuple(range(step_inputs.PER_TOKEN_MAX_CHUNK + 1)), 0, (0, 1, 2, 3, 4))
    with_long = [*chunks, long_prompt]
    assert step_inputs.per_token_tables(with_long, used(with_long)) is None
