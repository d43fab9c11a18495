"""PT2_COMPILE's fused step on the CPU, compiled ahead of time: one AOTInductor package per pool.

A fused step (engines/paged/forward.py's `FusedLayers`: every chunk short, each layer's attention one
call of the kernels' operator) is one graph under torch.compile too, but each call of it first passes
dynamo's entry: its guards, the fetching of the graph's inputs (every weight, some 280 tensors for the
GPT-2-small benchmark model), AOT's wrappers and the C++ wrapper's Python shim. That entry cost about
0.5 ms a step, an eighth of a quantized model's step. Here the fused forward is exported once
(`torch.export`, its token count, kept rows and block tables' width dynamic) and compiled by
AOTInductor into one shared object, which a step calls with its own six tensors and the pool's caches.
The engine sends it decode steps alone (engines/paged/engine.py, `_exported_covers`).

The weights stay the model's own: the package is compiled without them and handed the model's tensors
as user-managed constants, so it copies none (the caller keeps the model, and so them, alive). The
tensors that packing and quantization keep as plain module attributes (engines/cpu_prepack.py,
engines/quantized.py) are registered as parameters while the forward is exported, so that the package
names them by their place in the model: exported as attributes, they became constants numbered in no
order this could map back. The caches are inputs, which the kernels' operator writes in place.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from engines.paged import cpu_kernel
from engines.paged.forward import CONTEXT_KWARG, FusedLayers, StepContext
from engines.paged.step_context import StepTensors

# - Without its constants the package holds no copy of the weights (the oneDNN-packed ones would be
#   there twice): bfloat16's benchmark model added 857 MiB of RSS in scripts/aoti_decode_step.py.
# - AOTInductor's own kernels (layer norms with their residual adds, activations) run in parallel only
#   where each of the CPU's threads gets at least this many elements at the export's sample size (4
#   tokens; inductor's default is 512). A decode step's norms are a few thousand elements, and each
#   parallel one costs both threads a fork and a join; GPT-2-small's norms now run in the calling thread
#   while its MLP activation (3072 wide) stays parallel. Measured on 2 cores (Zen 4, AVX-512), benchmark
#   model under PT2_COMPILE, two servers side by side in paired rounds: int4 one stream's ITL p50 0.95x
#   (0.86-1.01, 20 rounds, faster in 17), 32 streams' tokens/s 0.99-1.04x; bfloat16 0.99x (0.89-1.06,
#   10 rounds) and 0.96-1.05x. In process, int4's decode step 0.95 / 0.97 / 1.00x at 1 / 4 / 32 rows.
PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False, "cpp.min_chunk_size": 4096}


def shim_options() -> dict[str, Any]:
    """The package's calls of the CPU kernels' operators go straight to their C shims
    (engines/paged/cpu_shims.cpp) instead of through AOTInductor's proxy executor, which boxes each
    call's arguments for the dispatcher: 61 calls a GPT-2-small decode step, all on the calling thread.
    Measured on 2 cores (Zen 4, AVX-512), the benchmark model's decode step in process at 96 positions,
    a package with the shims and one without called in turn (10 runs of 300 calls each): int4 0.970x
    (0.965-0.980, faster in every run), int8 0.975x, bfloat16 0.985x."""
    built = cpu_kernel.kernels()
    if built is None or not built.aoti_shims:
        return {}
    shims = {getattr(torch.ops.tgis, name).default: [shim] for name, shim in built.aoti_shims.items()}
    return {"aot_inductor.custom_ops_to_c_shims": shims}


class PackageConstantsError(ValueError):
    """The compiled package reads constants the model does not hold, which it was built without."""


class FusedStepForward(torch.nn.Module):
    """What is exported: the model's eager forward over one fused step, taking the step's tensors and
    the pool's caches as plain arguments and returning the kept rows' logits ([1, kept, vocab])."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any], kernel: Any) -> None:
        super().__init__()
        self.model = model  # so that the weights are named by their place in the model
        self._forward = forward  # the model's forward before PT2_COMPILE replaced it
        self._kernel = kernel

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        lengths: torch.Tensor,
        keep: torch.Tensor,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        context = StepContext(
            key_caches=key_caches,
            value_caches=value_caches,
            slot_mapping=slot_mapping,
            num_decode=0,  # the fused path reads only its own fields
            fused=FusedLayers(self._kernel, block_tables, lengths),
        )
        out = self._forward(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            **{CONTEXT_KWARG: context},
        )
        return out.logits


class ExportedFusedStep:
    """A loaded package of the fused step over one pool's caches."""

    def __init__(
        self, package: Any, constants: dict[str, torch.Tensor], caches: Sequence[torch.Tensor]
    ) -> None:
        self._run = package.loader.boxed_run
        self._constants = constants  # the package reads these tensors in place: kept alive with it
        self._caches = list(caches)
        self.steps = 0

    def __call__(self, tensors: StepTensors) -> torch.Tensor:
        """The kept rows' logits ([kept, vocab], the model's dtype) of a fused step."""
        self.steps += 1
        return self._run([*step_arguments(tensors), *self._caches])[0][0]


def step_arguments(tensors: StepTensors) -> list[torch.Tensor]:
    """A fused step's own tensors, as `FusedStepForward` takes them before the caches: token ids and
    positions ([1, T]), KV slots, per-token block tables and lengths, the rows whose logits are kept."""
    context = tensors.context
    fused = context.fused
    assert fused is not None
    return [
        tensors.input_ids[None],
        tensors.positions[None],
        context.slot_mapping,
        fused.block_tables,
        fused.lengths,
        tensors.keep,
    ]


def export_fused_step(
    model: torch.nn.Module, forward: Callable[..., Any], sample: StepTensors
) -> ExportedFusedStep:
    """Export and compile the fused step, traced on `sample` (a fused step of more tokens than rows kept
    and tables at least two blocks wide, so that no size is taken for a constant); raises what export
    or compilation raise, or PackageConstantsError when the package wants a constant the model does not
    hold."""
    context = sample.context
    assert context.fused is not None
    exported_module = FusedStepForward(model, forward, context.fused.kernel)
    args = (*step_arguments(sample), list(context.key_caches), list(context.value_caches))
    tokens, kept, width = Dim("tokens", min=1), Dim("kept", min=1), Dim("blocks", min=1)
    static = [None] * len(context.key_caches)
    dynamic = ({1: tokens}, {1: tokens}, {0: tokens}, {0: tokens, 1: width}, {0: tokens}, {0: kept})
    with _attributes_as_parameters(model) as attributes, torch.no_grad():
        program = torch.export.export(
            exported_module, args, dynamic_shapes=(*dynamic, static, static), strict=False
        )
        named: dict[str, torch.Tensor] = dict(exported_module.named_parameters(remove_duplicate=False))
        named |= dict(exported_module.named_buffers(remove_duplicate=False))
        # The attributes' own tensors, not the parameters that wrapped them for the export.
        own = {name: attributes.get(id(tensor), tensor) for name, tensor in named.items()}
    with tempfile.TemporaryDirectory() as scratch:
        path = torch._inductor.aoti_compile_and_package(
            program,
            package_path=str(Path(scratch) / "fused_step.pt2"),
            inductor_configs=PACKAGE_OPTIONS | shim_options(),
        )
        package = torch._inductor.aoti_load_package(path)
    wanted = package.get_constant_fqns()
    made = [name for name in wanted if name not in own]
    if made:
        # e.g. torch's int4 product, whose group size inductor's lowering turns into a tensor constant
        raise PackageConstantsError(
            f"AOTInductor made {len(made)} constants of its own ({', '.join(made[:3])}), which a package "
            "built without the weights does not hold"
        )
    constants = {name: own[name] for name in wanted}
    package.load_constants(constants, check_full_update=True, user_managed=True)
    return ExportedFusedStep(package, constants, [*context.key_caches, *context.value_caches])


@contextlib.contextmanager
def _attributes_as_parameters(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Every tensor kept as a plain module attribute registered as a parameter (no grad) of its module
    until the block ends, then put back as it was; yields each wrapping parameter's id mapped to the
    attribute's own tensor."""
    moved: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    wrapped: dict[int, torch.Tensor] = {}
    try:
        for module in model.modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor):
                    delattr(module, name)
                    moved.append((module, name, value))
                    parameter = torch.nn.Parameter(value, requires_grad=False)
                    module.register_parameter(name, parameter)
                    wrapped[id(parameter)] = value
        yield wrapped
    finally:
        for module, name, value in moved:
            module._parameters.pop(name, None)
            setattr(module, name, value)
