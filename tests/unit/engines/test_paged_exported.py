"""PT2_COMPILE's decode steps on the CPU, through the fused step exported and compiled ahead of time by
AOTInductor (engines/paged/exported_step.py): the same logits and cache writes as the eager step, over
decode batches and table widths, reading the model's own weights."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from transformers import PreTrainedModel

from engines.base import EngineSpec
from engines.compiled import compile_model
from engines.cpu_prepack import prepack_linears
from engines.paged import cpu_kernel, forward
from engines.paged.engine import PagedHFEngine, build
from engines.paged.step_inputs import PER_TOKEN_MAX_CHUNK
from engines.quantized import dense_weight, install_int4, int4_groupwise, linear_layers
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

BLOCK = 4
PROMPT = tuple(range(3, 3 + PER_TOKEN_MAX_CHUNK + 2))  # too long to fuse: attends eagerly


def _engine(compiled: bool, int4_group: int | None = None) -> tuple[PreTrainedModel, PagedHFEngine]:
    """The tiny llama's paged engine (float32, a pool of 24 blocks), its linears packed (or with
    `int4_group`, quantized to int4 in groups of that many) and its forward compiled as PT2_COMPILE does
    on the CPU when `compiled`."""
    model = make_model("llama").eval()
    if int4_group is not None:
        for _, layer in linear_layers(model):
            install_int4(layer, int4_groupwise(dense_weight(layer), int4_group), torch.float32)
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    engine = build(model, spec)
    if compiled:
        assert int4_group is not None or prepack_linears(model, min_bytes=0) > 0
        compile_model(model, kernel_operators=True, whole_graph=forward.traces_whole)
        engine.spec = dataclasses.replace(spec, supports_lora=False, whole_graph_steps=True)
    engine.allocate(24, BLOCK)
    return model, engine


def _steps() -> list[tuple[StepBatch, bool]]:
    """Steps over three sequences, each with whether the package serves it (decode tokens alone): a
    prompt too long to fuse, decode tokens whose tables are one block wide and then several, short
    prompts beside decode tokens, and a draft that keeps every row's logits (fused, but with prompt
    tokens: torch.compile's)."""
    one = SequenceChunk((5, 6), 0, (0,), sample=True)
    return [
        (StepBatch(prefill=(one,)), False),
        (StepBatch(decode=(SequenceChunk((7,), 2, (0,), sample=True),)), True),  # 1 token, 1 block
        (StepBatch(prefill=(SequenceChunk(PROMPT, 0, (4, 5, 6, 7, 8), sample=True),)), False),
        (
            StepBatch(
                decode=(
                    SequenceChunk((8,), 3, (0,), sample=True),
                    SequenceChunk((9,), len(PROMPT), (4, 5, 6, 7, 8), sample=True),
                ),
                prefill=(SequenceChunk((10, 11, 12), 0, (12,), sample=True),),
            ),
            False,
        ),
        (StepBatch(prefill=(SequenceChunk((13, 14, 15), 3, (12, 13), all_logits=True),)), False),  # a draft
        (
            StepBatch(
                decode=tuple(
                    SequenceChunk((16 + i,), start, table, sample=True)
                    for i, (start, table) in enumerate(
                        [(4, (0, 1)), (len(PROMPT) + 1, (4, 5, 6, 7, 8)), (6, (12, 13))]
                    )
                )
            ),
            True,
        ),
    ]


@pytest.mark.slow
def test_exported_decode_steps_give_the_eager_steps_logits_and_keys() -> None:
    """Decode steps of one sequence and of three, their tables one block wide or five, run through the
    package (the step count says so); every step, through it or not, gives the eager engine's logits,
    and the keys and values written reach the engine's pool."""
    if cpu_kernel.kernels() is None:
        pytest.fail("the CPU kernels must build on the test machine")
    _, eager = _engine(compiled=False)
    steps = _steps()
    expected = [eager.step(step) for step, _ in steps]

    _, engine = _engine(compiled=True)
    assert engine.export_fused_steps() is None
    exported = 0
    for (step, through_package), want in zip(steps, expected, strict=True):
        got = engine.step(step)
        exported += through_package
        assert engine.exported_steps == exported
        assert got.chunk_rows == want.chunk_rows
        assert got.logits.shape == want.logits.shape
        assert torch.allclose(got.logits, want.logits, atol=1e-4)
    for caches in ((engine._key_caches, eager._key_caches), (engine._value_caches, eager._value_caches)):
        for exported_cache, eager_cache in zip(*caches, strict=True):
            assert exported_cache.abs().sum() > 0
            assert torch.allclose(exported_cache, eager_cache, atol=1e-4)

    engine.allocate(24, BLOCK)  # a new pool: the package's caches are gone, torch.compile serves
    engine.step(steps[0][0])
    assert engine.exported_steps == 0


@pytest.mark.slow
def test_the_package_reads_the_models_own_weights() -> None:
    """The package holds no copy of the weights: zeroing the LM head's dense copy (a plain attribute
    that packing keeps for the few-row product) in the model after the export zeroes the logits that
    the package computes."""
    if cpu_kernel.kernels() is None:
        pytest.fail("the CPU kernels must build on the test machine")
    model, engine = _engine(compiled=True)
    assert engine.export_fused_steps() is None
    engine.step(StepBatch(prefill=(SequenceChunk((5, 6, 7), 0, (0,), sample=True),)))
    step = StepBatch(decode=(SequenceChunk((8,), 3, (0,), sample=True),))  # run twice: the same slot
    before = engine.step(step).logits
    assert before.abs().max() > 0
    head = model.get_output_embeddings()
    assert head.bias is None and head.few_rows_weight is not None
    head.few_rows_weight.zero_()
    after = engine.step(step).logits
    assert engine.exported_steps == 2
    assert torch.equal(after, torch.zeros_like(after))


@pytest.mark.slow
def test_the_package_calls_the_kernels_operators_through_their_shims() -> None:
    """The package calls the CPU kernels' operators through their C shims (cpu_shims.cpp), not through
    the dispatcher, whose calls torch's profiler records: a step through torch.compile records its
    attention and linear operators, a step through the package neither (only the few-row product that
    the packed linear calls inside through the dispatcher)."""
    built = cpu_kernel.kernels()
    if built is None:
        pytest.fail("the CPU kernels must build on the test machine")
    assert set(built.aoti_shims) == {
        "decode_layer",
        "packed_linear",
        "few_rows_linear",
        "int8_linear",
        "int4_linear",
    }
    _, engine = _engine(compiled=True)
    assert engine.export_fused_steps() is None

    def dispatched(step: StepBatch) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            engine.step(step)
        return {event.name for event in profile.events() if event.name.startswith("tgis::")}

    steps = _steps()
    assert {"tgis::decode_layer", "tgis::packed_linear"} <= dispatched(steps[0][0])
    assert engine.exported_steps == 0
    assert dispatched(steps[1][0]) == {"tgis::few_rows_linear"}
    assert engine.exported_steps == 1


def test_no_shims_are_declared_where_the_build_cannot_be_made_global(tmp_path) -> None:
    """A module that names no shared object, or one that is not loaded, leaves the package to AOTInductor's
    proxy executor: declaring shims whose symbols no loaded library exports would break the package."""
    assert cpu_kernel._global_shims(types.SimpleNamespace()) == {}
    assert cpu_kernel._global_shims(types.SimpleNamespace(__file__=str(tmp_path / "not_loaded.so"))) == {}


def test_only_compiled_whole_graph_steps_are_exported() -> None:
    """An eager engine has nothing to export, and says so."""
    _, engine = _engine(compiled=False)
    assert engine.export_fused_steps() == "only PT2_COMPILE's whole-graph CPU steps are exported"
    assert engine.exported_steps == 0


@pytest.mark.slow
def test_a_package_that_wants_constants_of_its_own_leaves_the_steps_to_torch_compile() -> None:
    """torch's int4 product (groups of 32, which the kernels' int4 product does not take): inductor
    turns its group size into a tensor constant of the package's own, which a package built without
    constants does not hold. The export says so, and the steps run through torch.compile, right."""
    if cpu_kernel.kernels() is None:
        pytest.fail("the CPU kernels must build on the test machine")
    _, eager = _engine(compiled=False, int4_group=32)
    _, engine = _engine(compiled=True, int4_group=32)
    reason = engine.export_fused_steps()
    assert reason is not None and reason.startswith("export failed: AOTInductor made ")
    assert "constants of its own" in reason
    for step in (
        StepBatch(prefill=(SequenceChunk((5, 6, 7), 0, (0,), sample=True),)),
        StepBatch(decode=(SequenceChunk((8,), 3, (0,), sample=True),)),
    ):
        assert torch.allclose(engine.step(step).logits, eager.step(step).logits, atol=1e-4)
    assert engine.exported_steps == 0
