"""PT2_COMPILE (SPEC §7): a model forward compiled by torch.compile with dynamic shapes, and its warm-up."""

from __future__ import annotations

import inspect
import logging
import random
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch._dynamo

from engines.base import Engine, EngineSpec, PrefillRow, PrefixEmbeddings
from engines.inductor_cache import clean_inductor_cache
from engines.step import PagedEngine, SequenceChunk, StepBatch

logger = logging.getLogger(__name__)

CompileOptions = dict[str, str | int | bool | Callable[..., Any]]
# Given a forward call's keyword arguments: whether it traces into one graph (no graph break).
WholeGraphCall = Callable[[Mapping[str, Any]], bool]

# A whole-graph call (CompiledForward's `whole_graph`) skips dynamo's guards on the model's modules: their
# weights, buffers and attributes. Nothing changes them while serving: a compiled engine refuses LoRA
# (engines/common.py), and a whole graph has no eager code between pieces that could set an attribute.
# What tells one step's graph from another's is in the call's arguments, still guarded. The skipped
# guards were most of the ~3,000 checked before each step (a weight's dtype, shape and strides, a
# module's type and dict): the GPT-2-small benchmark model's int8 step checked them in 816-879 us with
# caches as the weights' read leaves them, 323-432 us without (one core of an AVX-512 EPYC, Zen 4).
SKIP_MODULE_GUARDS: CompileOptions = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}

# Warm-up compiles a handful of graphs (prefill with and without prompt logits, decode, batch size 1
# vs many); the default cache of 8 per code object would be too tight once prefixes add their own.
DYNAMO_CACHE_SIZE_LIMIT = 64
_compiled_forwards: weakref.WeakSet[CompiledForward] = weakref.WeakSet()


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class CompiledForward:
    """A model's forward under torch.compile; after `seal()`, a new graph is logged as a recompile.

    With `whole_graph`, only the calls it picks (those that trace into one graph) are compiled, under
    an entry of their own; the others run the forward eagerly. Compiled, such a call would break the
    graph at every layer (its attention runs eagerly), and the pieces did harm beyond their own Python
    and guards. Dynamo keeps graphs per code object and runs the first cached one whose guards pass:
    the broken forward's first piece guards on nothing that tells the two kinds of call apart, so
    after the paged CPU step's warm-up a 2-sequence decode step of the GPT-2-small benchmark model
    matched it and ran in pieces, 38 ms against 28 ms eager (AVX2 EPYC, 2 cores). Under entries of
    their own, a later model's whole-graph decode step still ran in pieces after another model's
    broken steps in the same process; dynamo's log names the frames it gave up on after graph breaks
    in a layer loop, code that every model shares through transformers' wrappers.

    A whole-graph entry also skips dynamo's guards on the model's modules (`SKIP_MODULE_GUARDS`)."""

    def __init__(
        self,
        forward: Callable[..., Any],
        options: CompileOptions | None = None,
        whole_graph: WholeGraphCall | None = None,
    ) -> None:
        clean_inductor_cache()
        torch._dynamo.config.cache_size_limit = max(
            torch._dynamo.config.cache_size_limit, DYNAMO_CACHE_SIZE_LIMIT
        )
        # The modules' floats become constants (see _mark_attributes_static).
        torch._dynamo.config.specialize_float = True
        self._whole_graph = whole_graph
        entry = forward
        if whole_graph is not None:
            entry = _whole_graph_entry(forward)
            options = {**(options or {}), **SKIP_MODULE_GUARDS}
        self._compiled = torch.compile(entry, dynamic=True, options=options)
        self.eager = forward
        # Callers inspect the forward's parameters (position_ids, logits_to_keep): keep them visible.
        self.__signature__ = inspect.signature(forward)
        self._sealed_at: int | None = None
        self.recompiles = 0
        _compiled_forwards.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._whole_graph is not None and not self._whole_graph(kwargs):
            return self.eager(*args, **kwargs)
        out = self._compiled(*args, **kwargs)
        if self._sealed_at is not None and compiled_graphs() > self._sealed_at + self.recompiles:
            self.recompiles = compiled_graphs() - self._sealed_at
            logger.warning(
                f"PT2_COMPILE: a shape outside the warm-up compiled a new graph ({self.recompiles})"
            )
        return out

    def seal(self) -> None:
        """Warm-up is over: from now on every new graph is a recompile."""
        self._sealed_at = compiled_graphs()


def _whole_graph_entry(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` behind a code object of its own, which dynamo caches graphs under: no other compiled
    model's call, through the same transformers wrapper or another entry, shares its cache. Its guards
    skip the model's modules, so only this code object's own cache tells two models apart."""

    def whole_graph_entry(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    code = whole_graph_entry.__code__.replace()  # a new code object: every closure shares the original
    return types.FunctionType(
        code, whole_graph_entry.__globals__, code.co_name, None, whole_graph_entry.__closure__
    )


def compile_model(
    model: torch.nn.Module, *, kernel_operators: bool = False, whole_graph: WholeGraphCall | None = None
) -> CompiledForward:
    """Replace `model.forward` by its compiled form (inductor, dynamic shapes) and return it.

    On the CPU, the weights never change while serving (LoRA is refused when compiled). With
    `kernel_operators` (the paged step's CPU kernels are built, and cpu_prepack packed the layers or
    engines/quantized.py quantized them) inductor calls the packed layers (oneDNN, or the few-row
    product on their dense copies), the int8 layers and the paged step's attention as operators from
    its C++ wrapper: a fused step is one graph with no Python
    between its operators (a lone decode step of the GPT-2-small benchmark model 4-5 ms faster than
    eager on an AVX2 EPYC, before the few-row product). Without,
    the weights are frozen into the graph so that inductor lays them out itself (GPT-2 small, 21 rows
    a step: ~100 → ~75 ms on 2 cores). With `whole_graph`, only the calls it picks, those that trace
    into one graph, are compiled; the rest run eagerly (CompiledForward)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    _mark_attributes_static(model)
    options: CompileOptions | None = None
    if kernel_operators:
        # Without inductor's size asserts: before every call they checked each input's sizes and strides
        # again (a decode step of the GPT-2-small benchmark model passes some 280 tensors), after
        # dynamo's guards had checked them (and the kernels' outputs against their fake shapes, which the
        # compiled-step tests hold to eager's tokens). One stream's compiled int8 step: 0.95x (0.83-1.23,
        # 12 alternated rounds in two sets, 2-core AVX-512 EPYC).
        options = {"cpp_wrapper": True, "size_asserts": False}
    elif on_cpu:
        options = {"freezing": True}
    compiled = CompiledForward(model.forward, options, whole_graph)
    model.forward = compiled  # type: ignore[method-assign]
    return compiled


# What never changes while serving is compiled as static shapes. Under `dynamic=True` dynamo made
# every tensor it met dynamic but the modules' parameters and buffers: the tensors that quantization
# and packing keep as plain module attributes (engines/quantized.py, engines/cpu_prepack.py) and the KV
# caches (marked where they are allocated, engines/paged/engine.py). It also made the modules' floats
# (layer norms' eps, dropout's p, attention's scaling) symbols. Each such symbol became guards relating
# it to the others, checked in Python before every step, walking the modules: the GPT-2-small benchmark
# model's int8 step checked 415 of them. Static, 12 remain, and the whole check took 24 instead of 99
# us with warm caches, 188 instead of 544 us after a 64 MiB read (one core of an AVX-512 EPYC, Zen 4).
# A step's own inputs (its tokens, positions and block tables) stay dynamic.
def _mark_attributes_static(model: torch.nn.Module) -> None:
    """Compile the tensors kept as plain module attributes (quantized and packed weights) as static
    shapes, as dynamo does parameters and buffers (see the comment above)."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                torch._dynamo.mark_static(value)


def warm_up(
    engine: Engine,
    shapes: Sequence[tuple[int, int]],
    *,
    prefix_hidden_size: int | None = None,
    decode_steps: int = 2,
    seed: int = 0,
) -> int:
    """Run prefill and decode steps over (batch size, input length) shapes so that dynamo compiles every
    graph serving will use: batch size 1 and many, one token and many, with and without prompt
    logits, and a merge into a running batch; with `prefix_hidden_size`, prompt-tuning prefixes too
    (they enter as embeddings). Returns the number of graphs compiled."""
    before = compiled_graphs()
    source = _RandomRows(engine.spec, prefix_hidden_size, seed)
    variants = [False, True] if prefix_hidden_size is not None else [False]
    for batch, length in shapes:
        engine.clear()
        for prefixed in variants:  # merged into one running batch, one prefill after the other
            engine.prefill(source.rows(batch, length, prefixed=prefixed))
            engine.prefill(source.rows(1, max(1, length // 2), want_prompt_logits=True, prefixed=prefixed))
        for _ in range(decode_steps):
            engine.decode(source.tokens(engine.num_rows))
        engine.keep_rows([0])
        engine.decode(source.tokens(1))
    engine.clear()
    return _seal_after_warm_up(before, f"{len(shapes)} shapes")


class _RandomRows:
    """Prefill rows of random token ids for the padded warm-up: odd rows one token shorter, and where
    prefixed, every other row (or a lone row) led by two virtual tokens."""

    def __init__(self, spec: EngineSpec, prefix_hidden_size: int | None, seed: int) -> None:
        self.spec = spec
        self.prefix_hidden_size = prefix_hidden_size
        self.rng = random.Random(seed)

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(self.spec.vocab_size) for _ in range(count)]

    def rows(
        self, batch: int, length: int, want_prompt_logits: bool = False, prefixed: bool = False
    ) -> list[PrefillRow]:
        return [
            PrefillRow(
                self.tokens(max(1, length - i % 2)),
                want_prompt_logits=want_prompt_logits,
                prefix=self._prefix(2) if prefixed and (i % 2 or batch == 1) else None,
            )
            for i in range(batch)
        ]

    def _prefix(self, rows: int) -> PrefixEmbeddings | None:
        if self.prefix_hidden_size is None:
            return None
        spec = self.spec
        virtual = torch.zeros(rows, self.prefix_hidden_size, dtype=spec.dtype, device=spec.device)
        return PrefixEmbeddings(decoder=virtual, encoder=virtual if spec.is_encoder_decoder else None)


def warm_up_steps(
    engine: PagedEngine,
    max_step_tokens: int,
    block_size: int,
    num_blocks: int,
    *,
    max_sequence_length: int | None = None,
    prefix_hidden_size: int | None = None,
    seed: int = 0,
) -> int:
    """Run paged steps so that dynamo compiles every graph serving will use. Where attention is eager
    (CUDA), the graphs break around it and the pieces depend only on the step's token count (1, a
    few, many), the number of logits rows kept (1 or more) and whether prefixes enter as embeddings.
    On the CPU a step whose chunks are all short (decode tokens, drafts, short prompts) is one graph
    (the kernels' operators), which also depends on its block tables' width (1 block or more), so
    those steps run once more past the first blocks; the other steps run eagerly there
    (CompiledForward's `whole_graph`). The steps write into the first blocks of the pool, which hold
    nothing yet. Returns the number of graphs compiled."""
    before = compiled_graphs()
    chunks = _RandomChunks(engine.spec, block_size, prefix_hidden_size, seed)
    # A chunk from position 0 may not pass the model's positions (MAX_SEQUENCE_LENGTH): such a step runs
    # eagerly, and GPT-2's position table raises on it.
    longest = min(max_step_tokens, (num_blocks - 2) * block_size, max_sequence_length or max_step_tokens)
    many = max(3, longest)
    shapes = [[1], [2], [1, 1], [3, 3], [many - 1, 1] if many > 2 else [many], [many]]
    for prefixed in [False, True] if prefix_hidden_size is not None else [False]:
        for lengths in shapes:
            chunks.restart()
            engine.step(StepBatch(prefill=tuple(chunks.chunk(n, prefixed=prefixed) for n in lengths)))
        for all_logits in (False, True):
            chunks.restart()
            engine.step(StepBatch(prefill=(chunks.chunk(4, all_logits=all_logits, prefixed=prefixed),)))
        chunks.restart()
        engine.step(StepBatch(prefill=(chunks.chunk(many, all_logits=True, prefixed=prefixed),)))
    later = [([1], False), ([1, 1], False), ([3], False), ([5], True)] if num_blocks > 3 else []
    for lengths, all_logits in later:  # short chunks whose tables span 3 blocks: decodes, drafts
        chunks.restart()
        step = tuple(chunks.chunk(n, start=2 * block_size + 1, all_logits=all_logits) for n in lengths)
        engine.step(StepBatch(decode=step) if lengths[0] == 1 else StepBatch(prefill=step))
    return _seal_after_warm_up(before, f"{len(shapes) + 3 + len(later)} step shapes")


class _RandomChunks:
    """Whole prompts of random token ids for the paged warm-up, each in fresh blocks from the start of
    the pool until `restart`; prefixed ones led by up to two virtual tokens."""

    def __init__(self, spec: EngineSpec, block_size: int, prefix_hidden_size: int | None, seed: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.prefix_hidden_size = prefix_hidden_size
        self.rng = random.Random(seed)
        self.next_block = 0

    def restart(self) -> None:
        """The next step's chunks take the pool's first blocks again."""
        self.next_block = 0

    def chunk(
        self, length: int, *, start: int = 0, all_logits: bool = False, prefixed: bool = False
    ) -> SequenceChunk:
        blocks = -(-(start + length) // self.block_size)
        table = tuple(range(self.next_block, self.next_block + blocks))
        self.next_block += blocks
        prefix = None
        if prefixed:
            spec = self.spec
            virtual = torch.zeros(
                min(2, length), self.prefix_hidden_size or 0, dtype=spec.dtype, device=spec.device
            )
            prefix = PrefixEmbeddings(decoder=virtual)
        ids = tuple(self.rng.randrange(self.spec.vocab_size) for _ in range(length))
        return SequenceChunk(ids, start, table, sample=True, all_logits=all_logits, prefix=prefix)


def _seal_after_warm_up(before: int, shapes: str) -> int:
    """Seal every compiled forward (any later graph is a recompile); the graphs compiled since `before`."""
    compiled = compiled_graphs() - before
    for forward in _compiled_forwards:
        forward.seal()
    logger.info(f"PT2_COMPILE: warm-up over {shapes} compiled {compiled} graphs")
    return compiled
