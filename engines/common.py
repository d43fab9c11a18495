"""What every engine shares: padding new rows, the dtype and device to load in, the model class and EOS ids,
the name a forward takes its KV cache under, the LM head's inputs, a fixed thread count, and the choice
of the paged step and PT2_COMPILE.

No engine imports another's helpers: the transformers engine, the tensor-parallel one and ONNX
Runtime's all take these from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from engines.base import EngineConfig, EngineSpec, PrefillRow

if TYPE_CHECKING:
    from engines.paged.engine import PagedHFEngine

logger = logging.getLogger(__name__)
GENERATION_CONFIG_FILE = "generation_config.json"


class UnsupportedModelError(ValueError):
    pass


def left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad `tensor` on the left of `dim` up to `length`."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def right_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def left_padded_inputs(
    rows: Sequence[PrefillRow], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of new rows, left-padded to the longest so every row ends at the last column."""
    inputs = prefixed_inputs([row.input_ids for row in rows], [None] * len(rows), pad_token_id, device)
    return inputs.ids, inputs.mask


@dataclass
class PaddedInputs:
    """Left-padded new rows, each optionally led by prefix embeddings; every row ends at the last column."""

    ids: torch.Tensor  # [B, T]; prefix slots hold the pad id
    mask: torch.Tensor  # [B, T]; 1 over prefix and ids
    lengths: list[int]  # prefix + ids of each row
    prefixes: list[torch.Tensor | None]  # [P, hidden] per row

    @property
    def has_prefix(self) -> bool:
        return any(prefix is not None for prefix in self.prefixes)

    def embeddings(self, embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`embed(ids)` with each row's prefix written over its prefix slots."""
        embeds = embed(self.ids)
        width = self.ids.shape[1]
        for i, (prefix, length) in enumerate(zip(self.prefixes, self.lengths, strict=True)):
            if prefix is not None:
                start = width - length
                embeds[i, start : start + prefix.shape[0]] = prefix.to(embeds.device, embeds.dtype)
        return embeds


def prefixed_inputs(
    id_lists: Sequence[Sequence[int]],
    prefixes: list[torch.Tensor | None],
    pad_token_id: int,
    device: torch.device,
) -> PaddedInputs:
    """Rows of `prefixes[i]` (slots only: pad ids) then `id_lists[i]`, left-padded to the longest."""
    lengths = [prefixed_length(ids, prefix) for ids, prefix in zip(id_lists, prefixes, strict=True)]
    width = max(lengths)
    ids = torch.full((len(id_lists), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(id_lists), width), dtype=torch.long)
    for i, (row_ids, length) in enumerate(zip(id_lists, lengths, strict=True)):
        ids[i, width - len(row_ids) :] = torch.tensor(list(row_ids), dtype=torch.long)
        mask[i, width - length :] = 1
    return PaddedInputs(ids.to(device), mask.to(device), lengths, prefixes)


def prefixed_length(ids: Sequence[int], prefix: torch.Tensor | None) -> int:
    return len(ids) + (0 if prefix is None else int(prefix.shape[0]))


def resolve_device(name: str | None) -> torch.device:
    """The device to load on: the one named, else CUDA when present, else the CPU. A CUDA device always
    carries its index (`cuda` is the current device, `cuda:0` when CUDA_VISIBLE_DEVICES names one GPU):
    torch's memory queries refuse a device without one."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def avoid_per_shape_attention_builds(device: torch.device) -> None:
    """On CUDA, take cuDNN's attention out of SDPA's choices for this process. cuDNN builds an execution
    graph for every new shape, and a server meets a new shape almost every step (prompt lengths, cached
    contexts, batch sizes): on an H200 with torch 2.11 the first SDPA call at a new sequence length took
    40-60 ms (median; up to about 1 s) with cuDNN among the choices, and 0.1 ms without it. Flash,
    memory-efficient and math attention remain."""
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info("SDPA on CUDA: cuDNN attention off (it builds a graph for every new shape)")


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_has_native_bf16() -> bool:
    """avx512_bf16 or AMX: bfloat16 matmuls run natively (about 3× float32 on AVX-512 cores)."""
    return bool(torch.cpu._is_avx512_bf16_supported()) or amx_tiles()


@functools.cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN multiplies bfloat16 in (torch's own check)."""
    return bool(torch.cpu._is_amx_tile_supported())


def resolve_dtype(
    name: str | None,
    device: torch.device,
    *,
    cpu_bf16: bool = False,
    checkpoint: torch.dtype | None = None,
) -> torch.dtype:
    """DTYPE names as torch spells them. Unset on CUDA: float16 as in TGIS, except for a `checkpoint`
    saved in bfloat16, which runs in bfloat16 where the GPU computes it (a model trained in bfloat16
    can overflow float16's range: inf and NaN logits). Unset on CPU: float32, or with `cpu_bf16`
    bfloat16 where the CPU runs it natively."""
    if name is None:
        if device.type == "cuda":
            return _cuda_default(checkpoint)
        if cpu_bf16 and cpu_has_native_bf16():
            logger.info("DTYPE is not set: bfloat16, since this CPU computes it natively (avx512_bf16/AMX)")
            return torch.bfloat16
        return torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Unrecognized data type: {name}")
    return dtype


def _cuda_default(checkpoint: torch.dtype | None) -> torch.dtype:
    if checkpoint != torch.bfloat16:
        return torch.float16
    if not torch.cuda.is_bf16_supported():
        logger.warning("DTYPE is not set: float16, as this GPU lacks bfloat16 (the checkpoint is bfloat16)")
        return torch.float16
    logger.info("DTYPE is not set: bfloat16, the checkpoint's own (float16 could overflow its activations)")
    return torch.bfloat16


def checkpoint_dtype(config: transformers.PretrainedConfig) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are saved in (None: it does not say)."""
    saved = getattr(config.get_text_config(), "dtype", None) or getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else None


def auto_model_class(config: transformers.PretrainedConfig) -> Any:
    if type(config) in AutoModelForCausalLM._model_mapping and config.model_type != "bart":
        return AutoModelForCausalLM
    if type(config) in AutoModelForSeq2SeqLM._model_mapping:
        return AutoModelForSeq2SeqLM
    raise UnsupportedModelError(f"Unsupported model type {config.model_type}")


def config_eos_token_ids(
    config: transformers.PretrainedConfig, model_path: Path | None = None
) -> tuple[int, ...]:
    """Every id that ends a sequence: config.json's `eos_token_id`, then those generation_config.json
    names (a chat model's end-of-turn token, Llama-3's <|eot_id|>, is often only there); the first one
    is the pad fallback."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None and hasattr(config, "get_text_config"):
        eos = getattr(config.get_text_config(), "eos_token_id", None)
    ids = _as_ids(eos)
    generation = read_generation_config(model_path) if model_path is not None else None
    if generation is not None:
        ids += tuple(i for i in _as_ids(generation.eos_token_id) if i not in ids)
    return ids


def read_generation_config(model_path: Path) -> transformers.GenerationConfig | None:
    """The checkpoint's generation_config.json through transformers (None when it has none)."""
    if not (model_path / GENERATION_CONFIG_FILE).is_file():
        return None
    try:
        return transformers.GenerationConfig.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        logger.warning(f"{model_path / GENERATION_CONFIG_FILE} is not readable, so it is ignored: {exc}")
        return None


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(i) for i in value)
    return (int(value),)  # type: ignore[call-overload]


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its KV cache under: `cache` from transformers 5.24 on (which
    warns on the old name, and drops it in 5.40), `past_key_values` before it and in remote code."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned: `output.cache` from transformers 5.24 on, `past_key_values` before."""
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache


@contextlib.contextmanager
def lm_head_inputs(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """While it lasts, what the model's output embedding reads on each call is collected: its final,
    normed hidden states."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, torch.nn.Module):
        raise ValueError("the model has no output embedding to read hidden states from")
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _module, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


@contextlib.contextmanager
def fixed_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to `count` while it lasts (the count changes how float sums are
    split, so a reproducible build fixes it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def own_remaining_tensors(model: torch.nn.Module) -> None:
    """Copy the parameters and buffers left dense into memory of their own. Loaded in the
    checkpoint's dtype they are views of the memory-mapped safetensors file, and while any view
    remains the whole mapping stays resident, the packed layers' dense pages included."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if any(tensor.stride()) or tensor.dim() == 0:
            tensor.data = tensor.data.clone()


def return_freed_heap() -> None:
    """Give the released dense weights back to the OS: glibc keeps freed blocks under its mmap
    threshold in the heap until asked to trim it."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to ask
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---- the paged step or padded batches, and PT2_COMPILE: how the torch engines serve a loaded model. The
# paged engine and the compiler import this module, so these import them when called.


def paged_engine_if_possible(
    model: transformers.PreTrainedModel, spec: EngineSpec, config: EngineConfig
) -> PagedHFEngine | None:
    """The paged engine unless PAGED_ATTENTION=false or the model cannot run it (then None, or a
    startup error when the paged step was required)."""
    from engines.paged.engine import PagedUnsupportedError
    from engines.paged.engine import build as build_paged

    if config.paged is False:
        return None
    try:
        engine = build_paged(model, dataclasses.replace(spec, paged=True), config.kv_block_size)
    except PagedUnsupportedError as exc:
        reason = str(exc)
    else:
        logger.info("Serving with the paged step (flat batches over KV blocks, chunked prefill)")
        engine.spec = compiled_if_asked(model, engine.spec, config, paged=True)
        return engine
    if config.paged:
        raise UnsupportedModelError(
            f"The paged step (PAGED_ATTENTION / FLASH_ATTENTION) cannot serve: {reason}"
        )
    logger.info(f"Serving with padded batches: {reason}")
    return None


def compiled_if_asked(
    model: torch.nn.Module, spec: EngineSpec, config: EngineConfig, *, paged: bool = False
) -> EngineSpec:
    """PT2_COMPILE: compile the forward; LoRA is refused then, as peft's per-row hooks would recompile it.
    The paged step on the CPU keeps its packed linears and its attention kernel as operators of the
    graph where the kernels build and oneDNN packs the dtype (engines/compiled.py)."""
    from engines.compiled import compile_model
    from engines.cpu_prepack import prepack_linears
    from engines.paged import cpu_kernel, forward
    from engines.quantized import is_quantized

    if not config.compile:
        return spec
    operators = paged and spec.device.type == "cpu" and cpu_kernel.kernels() is not None
    # Every size packed, as PT2_COMPILE's graphs were measured: a graph of packed operators calls them
    # from its C++ wrapper, and a model with none is frozen for inductor instead (compile_model). A
    # quantized model's layers are the kernels' operators already (engines/quantized.py).
    packed = operators and prepack_linears(model, min_bytes=0) > 0
    quantized = operators and any(is_quantized(m) for m in model.modules())
    compile_model(
        model,
        kernel_operators=packed or quantized,
        whole_graph=forward.traces_whole if operators else None,
    )
    if operators:
        linears = "layers left to inductor"
        if packed or quantized:
            linears = "layers " + ("quantized" if quantized else "packed for oneDNN") + ", called as they are"
        logger.info(
            "PT2_COMPILE: the paged step's attention kernel is an operator of the compiled graph; "
            f"linear {linears}"
        )
    return dataclasses.replace(spec, supports_lora=False, whole_graph_steps=operators)
