"""The paged step's CUDA paths on a tiny model in bfloat16: the varlen kernel per layer (in place where
this torch's kernel takes a block table, over gathered keys everywhere) and decode graphs, against
transformers' own forward at a bfloat16 tolerance.

Marked `gpu`: skipped without CUDA. With CUDA they fail, not skip, when the fast path does not serve:
a run that silently fell back to the per-sequence torch path must not pass."""

from __future__ import annotations

import pytest
import torch

from engines.base import EngineSpec
from engines.paged import graphs, paths, varlen
from engines.paged.engine import PagedHFEngine, build
from engines.paged.step_context import AttentionPath
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model, relative

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16_TOLERANCE = 5e-2  # of the logits' magnitude (the engine's own self-test tolerance for bfloat16)
LENGTHS = [37, 10, 5, 21, 3, 16, 9, 30, 2, 12, 7, 25]  # prompts of 12 sequences (MAX_BATCH_SIZE's default)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def bf16_model():
    model = make_model("llama").eval()
    model.to(device(), torch.bfloat16)
    return model


def cuda_engine(dtype: torch.dtype = torch.bfloat16, block_size: int | None = None) -> PagedHFEngine:
    model = make_model("llama").eval()
    model.to(device(), dtype)
    spec = EngineSpec(False, model.config.vocab_size, (), 0, device(), dtype, paged=True)
    return build(model, spec, block_size)


def tables(block_size: int) -> list[tuple[int, ...]]:
    """Each sequence's own blocks, enough for its prompt and a few decode steps."""
    per_sequence = -(-(max(LENGTHS) + 8) // block_size)
    return [tuple(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(len(LENGTHS))]


def prompt_ids(i: int) -> tuple[int, ...]:
    return tuple((7 * i + 3 * p) % 700 + 4 for p in range(LENGTHS[i]))


def prefill_all(engine: PagedHFEngine) -> None:
    blocks = tables(engine.block_size)
    chunks = tuple(SequenceChunk(prompt_ids(i), 0, blocks[i], sample=True) for i in range(len(LENGTHS)))
    engine.step(StepBatch(prefill=chunks))


def decode_batch(engine: PagedHFEngine, count: int) -> StepBatch:
    blocks = tables(engine.block_size)
    return StepBatch(
        decode=tuple(SequenceChunk((5 + i,), LENGTHS[i], blocks[i], sample=True) for i in range(count))
    )


def transformers_decode_logits(count: int) -> torch.Tensor:
    """What transformers gives for each sequence's prompt followed by its decode token."""
    model = bf16_model()
    rows = []
    with torch.inference_mode():
        for i in range(count):
            ids = torch.tensor([[*prompt_ids(i), 5 + i]], device=device())
            rows.append(model(input_ids=ids, use_cache=False).logits[0, -1].float())
    return torch.stack(rows)


def test_the_fast_path_serves_bfloat16_at_the_default_block_size() -> None:
    engine = cuda_engine()
    choice = engine.attention
    assert choice.path.varlen, f"the per-sequence fallback serves: {choice.fallback}"
    if varlen.offer(device()).paged:
        assert choice.path is AttentionPath.VARLEN_PAGED, f"not in place: {choice.fallback}"


@pytest.mark.parametrize("path", [AttentionPath.VARLEN_PAGED, AttentionPath.VARLEN_GATHERED])
def test_each_varlen_path_gives_transformers_logits(path) -> None:
    """A step with decode tokens and a prompt chunk beside them, after prompts in earlier steps."""
    if path is AttentionPath.VARLEN_PAGED and not varlen.offer(device()).paged:
        pytest.skip(f"torch {torch.__version__}'s FlashAttention takes no block table")
    engine = cuda_engine()
    size = engine.preferred_block_size if path is AttentionPath.VARLEN_PAGED else 16
    geometry = engine._geometry()
    assert paths.probe(path, size, geometry, device()) is None
    engine.use_attention(paths.AttentionChoice(path, size, varlen.flash_varlen))
    engine.allocate(64, size)
    blocks = tables(size)
    first = StepBatch(
        prefill=tuple(SequenceChunk(prompt_ids(i), 0, blocks[i], sample=True) for i in range(2))
    )
    engine.step(first)
    third = SequenceChunk(prompt_ids(2), 0, blocks[2], all_logits=True)
    mixed = StepBatch(decode=decode_batch(engine, 2).decode, prefill=(third,))
    out = engine.step(mixed)
    assert relative(out.logits[:2], transformers_decode_logits(2)) <= BF16_TOLERANCE
    with torch.inference_mode():
        alone = bf16_model()(input_ids=torch.tensor([prompt_ids(2)], device=device()), use_cache=False)
    assert relative(out.logits[2:], alone.logits[0]) <= BF16_TOLERANCE


def test_decode_graphs_replay_between_buckets_with_padded_rows() -> None:
    """Batches of 1, 3 (a bucket of 4: one padding row), 5, 9 and 12 (MAX_BATCH_SIZE's default, its own
    bucket) replay graphs and give the eager step's and transformers' logits."""
    engine = cuda_engine()
    assert engine.attention.path.varlen, engine.attention.fallback
    engine.allocate(len(LENGTHS) * len(tables(engine.block_size)[0]) + 8, engine.preferred_block_size)
    prefill_all(engine)
    sizes = [1, 3, 5, 9, 12]
    eager = {count: engine.step(decode_batch(engine, count)).logits.clone() for count in sizes}
    assert engine.capture_decode_graphs(max_positions=64, max_batch=12) is None
    assert graphs.buckets_up_to(12) == (1, 2, 4, 8, 12)
    for count in sizes:
        before = engine.graph_replays
        replayed = engine.step(decode_batch(engine, count)).logits
        assert engine.graph_replays == before + 1, f"a batch of {count} ran eagerly"
        assert replayed.shape == eager[count].shape
        assert relative(replayed, eager[count]) <= BF16_TOLERANCE
    assert (
        relative(engine.step(decode_batch(engine, 12)).logits, transformers_decode_logits(12))
        <= BF16_TOLERANCE
    )


def test_a_step_beside_a_prompt_runs_eagerly_after_capture() -> None:
    engine = cuda_engine()
    engine.allocate(len(LENGTHS) * len(tables(engine.block_size)[0]) + 8, engine.preferred_block_size)
    prefill_all(engine)
    assert engine.capture_decode_graphs(max_positions=64, max_batch=4) is None
    replays = engine.graph_replays
    blocks = tables(engine.block_size)
    batch = StepBatch(
        decode=decode_batch(engine, 2).decode, prefill=(SequenceChunk((9, 9), 0, blocks[11], sample=True),)
    )
    engine.step(batch)
    assert engine.graph_replays == replays


def test_float32_is_served_by_the_torch_path_with_the_reason_named() -> None:
    """FlashAttention takes half precision only: float32 falls back, and says why."""
    engine = cuda_engine(torch.float32)
    assert engine.attention.path is AttentionPath.PER_SEQUENCE
    assert engine.attention.fallback and "probe" in engine.attention.fallback
