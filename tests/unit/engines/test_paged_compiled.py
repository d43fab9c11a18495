"""PT2_COMPILE on the paged CPU step: linears stay packed for oneDNN and a step of short chunks is one
compiled graph whose attention is the kernels' dispatcher operator (engines/compiled.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch._dynamo.utils
from transformers import PreTrainedModel

from engines.base import EngineSpec
from engines.compiled import compile_model, compiled_graphs, warm_up_steps
from engines.cpu_prepack import prepack_linears
from engines.paged import cpu_kernel, forward
from engines.paged.engine import PagedHFEngine, build
from engines.paged.step_inputs import PER_TOKEN_MAX_CHUNK
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

BLOCK = 4


def _engine(model: PreTrainedModel | None = None) -> tuple[PreTrainedModel, PagedHFEngine]:
    """The paged engine over `model` (default: the tiny llama), with a pool of 16 blocks."""
    model = make_model("llama").eval() if model is None else model
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    engine = build(model, spec)
    engine.allocate(16, BLOCK)
    return model, engine


@pytest.mark.slow
@pytest.mark.parametrize("packed", [True, False], ids=["packed-linears", "frozen-weights"])
def test_a_compiled_step_of_short_chunks_is_one_graph_with_the_kernels_operators(monkeypatch, packed) -> None:
    """Decode tokens, a short prompt and a draft over cached positions: compiled, the step gives the
    eager step's logits and keys, breaks no graph, and attends through torch.ops.tgis.decode_layer
    (the Python-bound kernel the eager step calls is never called); with the linears packed by
    cpu_prepack, or (where oneDNN cannot pack the dtype) frozen for inductor to lay out."""
    kernel = cpu_kernel.decode_layer_kernel()
    if kernel is None:
        pytest.fail("the CPU kernel must build on the test machine")
    calls: list[int] = []

    def counted(*args):
        calls.append(args[0].shape[2])
        return kernel(*args)

    monkeypatch.setattr(cpu_kernel, "decode_layer_kernel", lambda: counted)
    warm = (
        SequenceChunk(tuple(range(20, 25)), 0, (4, 5), all_logits=True),
        SequenceChunk(tuple(range(30, 36)), 0, (6, 7, 8), all_logits=True),
    )
    steps = [
        StepBatch(prefill=warm),
        StepBatch(
            decode=(SequenceChunk((7,), 5, (4, 5), sample=True),),
            prefill=(
                SequenceChunk(tuple(range(3, 12)), 0, (0, 1, 2), all_logits=True),  # a short prompt
                SequenceChunk((40, 41, 42, 43), 6, (6, 7, 8), all_logits=True),  # a draft after 6 cached
            ),
        ),
        StepBatch(
            decode=(
                SequenceChunk((9,), 6, (4, 5), sample=True),
                SequenceChunk((8,), 9, (0, 1, 2), sample=True),
            )
        ),
    ]
    eager_model, eager = _engine()
    calls.clear()  # the load's self-test steps
    expected = [eager.step(step) for step in steps]
    eager_keys = [cache.clone() for cache in eager._key_caches]
    layers = eager_model.config.num_hidden_layers
    assert calls == [11] * layers + [14] * layers + [2] * layers  # the eager steps took the kernel

    model, engine = _engine()
    if packed:
        assert prepack_linears(model, min_bytes=0) > 0
    compile_model(model, kernel_operators=packed)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    graphs = compiled_graphs()
    calls.clear()
    got = [engine.step(step) for step in steps]
    assert calls == []  # every layer's attention ran inside the graph, as the dispatcher operator
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert compiled_graphs() - graphs <= len(steps)  # at most one graph a step shape, nothing in pieces
    for compiled_out, eager_out in zip(got, expected, strict=True):
        assert compiled_out.chunk_rows == eager_out.chunk_rows
        assert torch.allclose(compiled_out.logits, eager_out.logits, atol=1e-4)
    for a, b in zip(engine._key_caches, eager_keys, strict=True):  # the writes reached the pool
        assert torch.allclose(a, b, atol=1e-4)


def _compiled_regions(run: Callable[[], object]) -> int:
    """How many compiled graphs `run()` entered."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return sum(1 for event in profile.events() if event.name.startswith("Torch-Compiled Region"))


@pytest.mark.slow
def test_steps_that_would_break_the_graph_run_eagerly_and_leave_the_others_whole() -> None:
    """A long prompt chunk attends eagerly, so compiled it would break the forward at every layer: it
    enters no compiled graph. A decode step of two sequences after it runs as one graph, and every
    step's logits are the eager engine's. (Compiling both kinds under one entry, the broken
    forward's first piece caught the later decode steps, which then ran in pieces.)"""
    if cpu_kernel.kernels() is None:
        pytest.fail("the CPU kernels must build on the test machine")
    prompt = tuple(range(3, 3 + PER_TOKEN_MAX_CHUNK + 2))
    tables = ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))

    def decode(position: int) -> StepBatch:
        return StepBatch(
            decode=tuple(
                SequenceChunk((7 + i,), position, table, sample=True) for i, table in enumerate(tables)
            )
        )

    steps = [
        StepBatch(prefill=tuple(SequenceChunk(prompt, 0, table, sample=True) for table in tables)),
        decode(len(prompt)),
        StepBatch(prefill=(SequenceChunk(prompt, 0, (10, 11, 12, 13, 14), sample=True),)),
        decode(len(prompt) + 1),
    ]
    _, eager = _engine()
    expected = [eager.step(step).logits for step in steps]

    model, engine = _engine()
    assert prepack_linears(model, min_bytes=0) > 0
    compile_model(model, kernel_operators=True, whole_graph=forward.traces_whole)
    got: list[torch.Tensor] = []

    def run(step: StepBatch) -> Callable[[], None]:
        return lambda: got.append(engine.step(step).logits)

    regions = [_compiled_regions(run(step)) for step in steps]
    assert regions == [0, 1, 0, 1]
    for compiled_logits, eager_logits in zip(got, expected, strict=True):
        assert torch.allclose(compiled_logits, eager_logits, atol=1e-4)


def _logits_into(out: list[torch.Tensor], engine: PagedHFEngine, step: StepBatch) -> None:
    out.append(engine.step(step).logits)


@pytest.mark.slow
def test_each_whole_graph_model_keeps_its_own_graphs() -> None:
    """A whole-graph entry skips dynamo's guards on the model's modules, so only its own cache tells
    models apart: a second model of the same class and shapes, with other weights and another
    activation (a submodule, traced into the graph), compiled after the first in the same process,
    runs graphs of its own and gives its eager logits (the first model's graphs would pass every
    guard left and apply the first model's activation)."""
    if cpu_kernel.kernels() is None:
        pytest.fail("the CPU kernels must build on the test machine")
    steps = [
        StepBatch(prefill=(SequenceChunk(tuple(range(3, 8)), 0, (0, 1), sample=True),)),
        StepBatch(decode=(SequenceChunk((9,), 5, (0, 1), sample=True),)),
    ]

    def other_weights_and_activation(model: PreTrainedModel) -> PreTrainedModel:
        with torch.no_grad():
            for weight in model.parameters():
                weight.mul_(0.5)
        for module in model.modules():
            if hasattr(module, "act_fn"):  # each layer's MLP
                module.act_fn = torch.nn.Tanh()
        return model

    logits: dict[str, list[torch.Tensor]] = {}
    for name, change in (("first", lambda m: m), ("second", other_weights_and_activation)):
        _, eager = _engine(change(make_model("llama").eval()))
        expected = [eager.step(step).logits for step in steps]
        model, engine = _engine(change(make_model("llama").eval()))
        prepack_linears(model, min_bytes=0)
        compile_model(model, kernel_operators=True, whole_graph=forward.traces_whole)
        got: list[torch.Tensor] = []
        regions = [_compiled_regions(functools.partial(_logits_into, got, engine, step)) for step in steps]
        assert regions == [1, 1]  # both steps ran compiled
        for compiled_logits, eager_logits in zip(got, expected, strict=True):
            assert torch.allclose(compiled_logits, eager_logits, atol=1e-4)
        logits[name] = got
    assert not torch.allclose(logits["first"][1], logits["second"][1], atol=1e-2)  # two different models


@pytest.mark.slow
def test_the_warm_up_keeps_its_chunks_within_the_models_positions() -> None:
    """The step budget (MAX_STEP_TOKENS) may exceed the model's positions; the warm-up's longest chunk
    from position 0 stays within MAX_SEQUENCE_LENGTH (the model's 256 here), where GPT-2's position
    table would raise on an eager step and be read past in a compiled one."""
    model = make_model("gpt2").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    engine = build(model, spec)
    engine.allocate(200, BLOCK)
    packed = prepack_linears(model, min_bytes=0) > 0
    compile_model(model, kernel_operators=packed, whole_graph=forward.traces_whole)
    positions = model.config.n_positions
    with pytest.raises(IndexError):  # the step budget alone would take a chunk past the positions
        warm_up_steps(engine, 2 * positions, BLOCK, 200)
    warm_up_steps(engine, 2 * positions, BLOCK, 200, max_sequence_length=positions)  # raises nothing


def test_packed_linear_operator_computes_the_linear_layer() -> None:
    """torch.ops.tgis.packed_linear is the linear layer, with and without a bias, through oneDNN's
    packed weight, or through the few-row product on the dense copy up to `few_rows` rows."""
    if cpu_kernel.kernels() is None:
        pytest.fail("the CPU kernels must build on the test machine")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator)
    bias = torch.randn(48, generator=generator)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    for rows in (1, 3, 9):
        inputs = torch.randn(1, rows, 32, generator=generator)
        for b in (bias, None):
            for dense in (weight, None):
                got = torch.ops.tgis.packed_linear(inputs, packed, b, dense, 4)
                assert got.shape == (1, rows, 48)
                assert torch.allclose(got, torch.nn.functional.linear(inputs, weight, b), atol=1e-5)
