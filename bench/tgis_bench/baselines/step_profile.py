"""Where a lone stream's decode step goes: the paged engine's step at batch 1, timed, then profiled.

The model loads as the server loads it (DTYPE, the CPU's packed linears, the paged attention), a
prompt is prefilled, and decode steps run one after another on the same sequence. Each step is timed
alone (`time.perf_counter`), then a run of steps goes under torch's profiler, with labels around the
step, the model's forward, the attention function and the LM head; every operator's own time is put
in one bucket. What no operator accounts for is Python: the step's inputs and outputs around the
model, and transformers' modules between the operators inside it. The profiler's own cost per
operator inflates the many-small-operator buckets; the unprofiled step time is the figure to trust
for the total. Then the same architecture at width 64 (`build_thin_twin`) is loaded and timed the same
way: its step, whose operators each work on almost nothing, is the part of the step that comes with
running its operators one by one (what a compiled graph of fused kernels would save, at most).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch

    from engines.paged.engine import PagedHFEngine

STEP, MODEL, ATTENTION, LM_HEAD = "tgis::step", "tgis::model", "tgis::attention", "tgis::lm_head"
WARMUP_STEPS = 4
BLOCK_SIZE = 16

LINEAR_OPS = frozenset(
    {
        "mkldnn::_linear_pointwise", "tgis::few_rows_linear", "aten::addmm", "aten::mm", "aten::bmm",
        "aten::linear", "aten::matmul",
    }
)  # fmt: skip
BOOKKEEPING_OPS = frozenset(
    {
        "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::as_strided",
        "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::transpose", "aten::t",
        "aten::permute", "aten::slice", "aten::select", "aten::narrow", "aten::unsqueeze", "aten::squeeze",
        "aten::expand", "aten::split", "aten::contiguous", "aten::clone", "aten::copy_", "aten::to",
        "aten::_to_copy", "aten::detach", "aten::alias", "aten::dropout", "aten::lift_fresh",
        "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
    }
)  # fmt: skip
ACTIVATION_WORDS = ("gelu", "silu", "relu", "tanh", "sigmoid", "softmax")

# The buckets, in the order the table lists them.
BUCKETS = (
    "linear layers (matmuls)",
    "LM head",
    "attention (KV write and kernel)",
    "norms",
    "activations",
    "other math (residual adds, embeddings...)",
    "tensor bookkeeping (views, allocations, copies)",
    "Python in transformers' modules",
    "step inputs and outputs (tgis)",
)


@dataclass(frozen=True)
class StepProfile:
    """Decode steps at batch 1 after a `prompt_tokens` prompt: the unprofiled step time and the
    profiled milliseconds per step of each bucket."""

    dtype: str
    prompt_tokens: int
    steps: int
    step_ms_p50: float
    step_ms_min: float
    profiled_ms: dict[str, float]  # per step, by bucket
    operators_per_step: float

    def lines(self) -> list[str]:
        total = sum(self.profiled_ms.values())
        lines = [
            f"Decode step at batch 1, {self.dtype}, after a {self.prompt_tokens}-token prompt, {self.steps} "
            f"steps: **{self.step_ms_p50:.2f} ms** p50 (min {self.step_ms_min:.2f} ms) unprofiled; "
            f"{self.operators_per_step:.0f} torch operators per step.",
            "",
            "| Where (profiled) | ms per step | Share |",
            "|---|---:|---:|",
        ]
        for bucket in BUCKETS:
            ms = self.profiled_ms.get(bucket, 0.0)
            lines.append(f"| {bucket} | {ms:.2f} | {ms / total:.1%} |")
        lines.append(f"| **profiled step** | {total:.2f} | 100% |")
        return lines


def positions_taken(prompt_tokens: int, steps: int) -> int:
    """Positions a `profile_decode_step` run fills: the prompt, the warmup, the timed and the profiled
    steps, and one to spare."""
    return prompt_tokens + WARMUP_STEPS + 2 * steps + 1


def profile_decode_step(engine: PagedHFEngine, dtype: str, *, prompt_tokens: int, steps: int) -> StepProfile:
    """Time `steps` decode steps of one sequence, then profile as many more."""
    from torch.profiler import ProfilerActivity, profile

    from engines.step import SequenceChunk, StepBatch
    from tgis.config import model_max_sequence_length

    block_size = engine.block_size
    positions = positions_taken(prompt_tokens, steps)
    limit = model_max_sequence_length(engine.spec.model_config)
    if positions > limit:
        raise ValueError(
            f"a {prompt_tokens}-token prompt, {WARMUP_STEPS} warmup steps and {steps} timed and {steps} "
            f"profiled steps take {positions} positions; the model has {limit}"
        )
    blocks = -(-positions // block_size)
    if blocks > engine.num_blocks:
        raise ValueError(f"the engine's pool holds {engine.num_blocks} blocks; this run needs {blocks}")
    table = tuple(range(blocks))
    prompt = tuple(i % 97 + 3 for i in range(prompt_tokens))
    engine.step(StepBatch(prefill=(SequenceChunk(prompt, 0, table, sample=True),)))
    position = prompt_tokens

    def decode() -> None:
        nonlocal position
        output = engine.step(StepBatch(decode=(SequenceChunk((5,), position, table, sample=True),)))
        int(output.logits[0].argmax())  # the step's result read, as the sampler would
        position += 1

    for _ in range(WARMUP_STEPS):
        decode()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        decode()
        seconds.append(time.perf_counter() - started)
    with _labelled(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with _label(STEP):
                decode()
    events = list(prof.events())
    return StepProfile(
        dtype=dtype,
        prompt_tokens=prompt_tokens,
        steps=steps,
        step_ms_p50=statistics.median(seconds) * 1e3,
        step_ms_min=min(seconds) * 1e3,
        profiled_ms={bucket: ms / steps for bucket, ms in bucket_times(events).items()},
        operators_per_step=sum(1 for e in events if not e.name.startswith("tgis::")) / steps,
    )


FLOOR_WIDTH = 64


def build_thin_twin(model_dir: Path, into: Path, width: int = FLOOR_WIDTH) -> Path:
    """The model's architecture at `width`: its layers, vocabulary, activation and norms, one attention
    head (and one kv head) of `width`, an MLP four times as wide, random weights, and its tokenizer,
    saved in `into`. Served the same way, its step runs the same operators as the model's, each on
    almost nothing: what is left is the step's cost per operator (Python, dispatch, oneDNN's setup of
    each call, attention's fixed part), whatever the model's size."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_size = width  # config.attribute_map names each family's own field (GPT-2: n_embd)
    config.num_attention_heads = 1
    for name, value in (("num_key_value_heads", 1), ("head_dim", width), ("intermediate_size", 4 * width)):
        if getattr(config, name, None) is not None:
            setattr(config, name, value)
    if getattr(config, "n_inner", None) is not None:  # GPT-2's MLP width, when not 4 x n_embd
        config.n_inner = 4 * width
    AutoModelForCausalLM.from_config(config).save_pretrained(into)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(into)
    return into


def floor_lines(model: StepProfile, floor: StepProfile, width: int = FLOOR_WIDTH) -> list[str]:
    """The thin twin's step (`build_thin_twin`) set against the model's."""
    linear = floor.profiled_ms["linear layers (matmuls)"]
    python = floor.profiled_ms["Python in transformers' modules"]
    return [
        f"The same architecture at width {width} (`build_thin_twin`: every operator of the step, on almost "
        f"nothing), served the same way: **{floor.step_ms_p50:.2f} ms** p50 a step, "
        f"{floor.step_ms_p50 / model.step_ms_p50:.0%} of the step above: what the step costs per operator, "
        f"whatever the model's size (profiled: {linear:.2f} ms of it in linear layers, "
        f"{python:.2f} ms Python in transformers' modules).",
    ]


def bucket_times(events: list[Any]) -> dict[str, float]:
    """Milliseconds of own (self) time per bucket over torch profiler events (FunctionEvent: name,
    self_cpu_time_total in µs, cpu_parent)."""
    totals: dict[str, float] = dict.fromkeys(BUCKETS, 0.0)
    for event in events:
        totals[bucket_of(event.name, _labels_above(event))] += event.self_cpu_time_total / 1e3
    return totals


def bucket_of(name: str, labels: tuple[str, ...]) -> str:
    """The bucket of an operator or label called `name`, inside the labels `labels` (innermost first)."""
    enclosing = (name, *labels)
    if ATTENTION in enclosing:
        return "attention (KV write and kernel)"
    if LM_HEAD in enclosing:
        return "LM head"
    if MODEL not in enclosing:
        return "step inputs and outputs (tgis)"
    if name == MODEL:
        return "Python in transformers' modules"
    if name in LINEAR_OPS:
        return "linear layers (matmuls)"
    if name in BOOKKEEPING_OPS:
        return "tensor bookkeeping (views, allocations, copies)"
    if "norm" in name:
        return "norms"
    if any(word in name for word in ACTIVATION_WORDS):
        return "activations"
    return "other math (residual adds, embeddings...)"


def _labels_above(event: Any) -> tuple[str, ...]:
    labels = []
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("tgis::"):
            labels.append(parent.name)
        parent = parent.cpu_parent
    return tuple(labels)


@contextlib.contextmanager
def _label(name: str) -> Iterator[None]:
    import torch

    with torch.profiler.record_function(name):
        yield


@contextlib.contextmanager
def _labelled(engine: PagedHFEngine) -> Iterator[None]:
    """While it lasts, the model's forward, its LM head and the paged attention function carry labels."""
    from transformers import AttentionInterface

    from engines.paged import forward

    head = engine.model.get_output_embeddings()
    assert head is not None
    attend = cast(Callable[..., Any], AttentionInterface._global_mapping[forward.ATTENTION_NAME])
    AttentionInterface.register(forward.ATTENTION_NAME, _labelled_call(ATTENTION, attend))
    hooks = [*_label_module(engine.model, MODEL), *_label_module(head, LM_HEAD)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        AttentionInterface.register(forward.ATTENTION_NAME, attend)


def _labelled_call(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with _label(name):
            return function(*args, **kwargs)

    return call


def _label_module(module: torch.nn.Module, name: str) -> list[Any]:
    """Hooks that open a label before the module's forward and close it after."""
    import torch

    open_labels: list[Any] = []

    def enter(*_: Any) -> None:
        label = torch.profiler.record_function(name)
        label.__enter__()
        open_labels.append(label)

    def leave(*_: Any) -> None:
        open_labels.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def main(argv: list[str]) -> int:
    """`tgis-bench profile-step`: load the model as the server would, print the table."""
    import argparse
    import os
    import tempfile

    from tgis.openmp import default_spin_count

    default_spin_count(os.environ)  # the OpenMP spin the server runs with, before torch loads
    from transformers import AutoTokenizer

    from engines.cpu_prepack import packing_every_size
    from engines.paged.engine import PagedHFEngine
    from tgis.config import Settings
    from tgis.startup.model import load_model
    from tgis_bench.baselines.token_costs import measure_token_costs
    from tgis_bench.load.cli import default_dtype
    from tgis_bench.models.build import ensure_bench_model

    p = argparse.ArgumentParser(prog="tgis-bench profile-step", description=__doc__)
    p.add_argument("--model-dir", type=Path, default=None, help="default: the GPT-2-small benchmark model")
    p.add_argument("--dtype", default=None, help="default: what the server picks on this CPU")
    p.add_argument(
        "--quantize", default=None, help="QUANTIZE for the model (int8, int4): as the server loads it"
    )
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    model_dir = args.model_dir or ensure_bench_model()
    dtype = args.dtype or default_dtype()
    positions = positions_taken(args.prompt_tokens, args.steps)

    def profile(directory: Path) -> tuple[PagedHFEngine, StepProfile]:
        settings = Settings(model_name=str(directory), dtype=dtype, quantize=args.quantize)
        engine = load_model(settings, {**os.environ, "MODEL_NAME": str(directory)}).engine
        if not isinstance(engine, PagedHFEngine):
            p.error(f"{directory} does not load on the paged engine")
        engine.allocate(-(-positions // BLOCK_SIZE), BLOCK_SIZE)
        try:
            label = dtype if args.quantize is None else f"{dtype}, QUANTIZE={args.quantize}"
            result = profile_decode_step(engine, label, prompt_tokens=args.prompt_tokens, steps=args.steps)
        except ValueError as exc:
            p.error(str(exc))
        return engine, result

    engine, result = profile(model_dir)
    # The twin's layers are packed whatever their size, standing for the model's (PACK_MIN_BYTES).
    with tempfile.TemporaryDirectory(prefix="tgis-thin-twin-") as twin, packing_every_size():
        floor = profile(build_thin_twin(model_dir, Path(twin)))[1]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    costs = measure_token_costs(tokenizer, engine.spec.vocab_size, engine.spec.eos_token_ids)
    text = "\n".join([*result.lines(), "", *floor_lines(result, floor), "", *costs.lines()])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0
