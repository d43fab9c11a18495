"""Runs ONNX exports of a transformers model on ONNX Runtime over a left-padded batch with its KV cache.

optimum's ORT integration (optimum-onnx) pins transformers < 4.58, so this engine produces the
ONNX graphs itself with torch.onnx, in optimum's non-merged layout and I/O naming: a graph without
past (prefill), a graph with past (one token per row) and, for encoder-decoder models, an encoder.
The KV cache lives here as tensors and is merged and pruned exactly as in hf_transformers.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import transformers
from transformers import AutoConfig
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from engines.base import EngineConfig, EngineSpec, PrefillResult, PrefillRow
from engines.common import (
    auto_model_class,
    config_eos_token_ids,
    left_pad,
    left_padded_inputs,
    resolve_dtype,
    right_pad,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENCODER = "encoder_model.onnx"
DECODER = "decoder_model.onnx"
DECODER_WITH_PAST = "decoder_with_past_model.onnx"
OPSET = 17


# ---- export ------------------------------------------------------------------------------------------


def _graph_files(is_encoder_decoder: bool) -> tuple[str, ...]:
    return (ENCODER, DECODER, DECODER_WITH_PAST) if is_encoder_decoder else (DECODER, DECODER_WITH_PAST)


def _flat(cache: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for layer in cache.layers:
        tensors += [layer.keys, layer.values]
    return tensors


def _pairs(flat: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


class _CausalStep(torch.nn.Module):
    """Decoder-only forward over flat past tensors, as the exporter needs plain tensors in and out."""

    def __init__(self, model: Any, takes_position_ids: bool) -> None:
        super().__init__()
        self.model = model
        self.takes_position_ids = takes_position_ids

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache(_pairs(past)) if past else DynamicCache()
        kwargs = {"position_ids": position_ids} if self.takes_position_ids else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
        return (out.logits, *_flat(out.past_key_values))


class _Encoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class _Seq2SeqFirstStep(torch.nn.Module):
    """The decoder's first token: computes the cross-attention cache from the encoder states."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, encoder_attention_mask, encoder_hidden_states):
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        out = self.model(
            encoder_outputs=(encoder_hidden_states,),
            attention_mask=encoder_attention_mask,
            decoder_input_ids=input_ids,
            past_key_values=cache,
            use_cache=True,
        )
        caches = out.past_key_values
        return (out.logits, *_flat(caches.self_attention_cache), *_flat(caches.cross_attention_cache))


class _Seq2SeqStep(torch.nn.Module):
    """One decoder token per row, with the self- and cross-attention caches as inputs."""

    def __init__(self, model: Any, layers: int) -> None:
        super().__init__()
        self.model = model
        self.layers = layers

    def forward(self, input_ids, decoder_attention_mask, encoder_attention_mask, *past):
        own, cross = past[: 2 * self.layers], past[2 * self.layers :]
        # A filled cross cache is reused as is; the encoder states only mark the layers as
        # cross-attention, so a zero tensor of the right shape stands in for them.
        rows, source = encoder_attention_mask.shape
        states = torch.zeros(rows, source, self.model.config.d_model, dtype=cross[0].dtype)
        cache = EncoderDecoderCache(DynamicCache(_pairs(own)), DynamicCache(_pairs(cross)))
        out = self.model(
            encoder_outputs=(states,),
            attention_mask=encoder_attention_mask,
            decoder_input_ids=input_ids,
            decoder_attention_mask=decoder_attention_mask,
            past_key_values=cache,
            use_cache=True,
        )
        return (out.logits, *_flat(out.past_key_values.self_attention_cache))


def _names(prefix: str, layers: int, part: str = "") -> list[str]:
    return [f"{prefix}.{i}{part}.{kind}" for i in range(layers) for kind in ("key", "value")]


Axes = dict[int, str]
ROWS: Axes = {0: "batch"}
ROWS_BY_SEQUENCE: Axes = {0: "batch", 1: "sequence"}
ROWS_BY_TOTAL: Axes = {0: "batch", 1: "total_sequence"}
ROWS_BY_SOURCE: Axes = {0: "batch", 1: "encoder_sequence"}
PAST: Axes = {0: "batch", 2: "past_sequence"}
PRESENT: Axes = {0: "batch", 2: "total_sequence"}
CROSS: Axes = {0: "batch", 2: "encoder_sequence"}


def _each(names: list[str], axes: Axes) -> dict[str, Axes]:
    return {name: dict(axes) for name in names}


def _export(
    module: torch.nn.Module, args: tuple, path: Path, inputs: dict[str, Axes], outputs: dict[str, Axes]
) -> None:
    """Trace `module` on `args` into `path`; inputs and outputs in order, with their dynamic axes."""
    with warnings.catch_warnings(), torch.no_grad():
        # The tracer warns about every Python-level shape check; the example inputs are chosen
        # (two rows, one padded) so that the general branch is the one traced.
        warnings.simplefilter("ignore")
        torch.onnx.export(  # the TorchScript exporter: torch.export cannot yet take these models
            module,
            args,
            str(path),
            input_names=list(inputs),
            output_names=list(outputs),
            dynamic_axes=inputs | outputs,
            opset_version=OPSET,
            dynamo=False,
        )


def _example_mask(rows: int, length: int) -> torch.Tensor:
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, : length // 2] = 0
    return mask


def _export_causal(model: Any, out_dir: Path) -> None:
    layers = model.config.get_text_config().num_hidden_layers
    step = _CausalStep(model, "position_ids" in inspect.signature(model.forward).parameters)
    ids = torch.full((2, 6), 5, dtype=torch.long)
    mask = _example_mask(2, 6)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    presents = {"logits": ROWS_BY_SEQUENCE} | _each(_names("present", layers), PRESENT)
    prompt = {
        "input_ids": ROWS_BY_SEQUENCE,
        "attention_mask": ROWS_BY_SEQUENCE,
        "position_ids": ROWS_BY_SEQUENCE,
    }
    _export(step, (ids, mask, positions), out_dir / DECODER, prompt, presents)
    with torch.no_grad():
        past = step(ids, mask, positions)[1:]
    one_token = {"input_ids": ROWS, "attention_mask": ROWS_BY_TOTAL, "position_ids": ROWS}
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    _export(
        step,
        (ids[:, :1], mask, positions[:, -1:] + 1, *past),
        out_dir / DECODER_WITH_PAST,
        one_token | _each(_names("past_key_values", layers), PAST),
        presents | {"logits": ROWS},
    )


def _export_seq2seq(model: Any, out_dir: Path) -> None:
    ids = torch.full((2, 6), 5, dtype=torch.long)
    mask = _example_mask(2, 6)
    encoder = _Encoder(model)
    source = {"input_ids": ROWS_BY_SOURCE, "attention_mask": ROWS_BY_SOURCE}
    _export(encoder, (ids, mask), out_dir / ENCODER, source, {"last_hidden_state": ROWS_BY_SOURCE})
    with torch.no_grad():
        states = encoder(ids, mask)
    start = torch.full((2, 1), model.config.decoder_start_token_id, dtype=torch.long)
    first = _Seq2SeqFirstStep(model)
    with torch.no_grad():
        past = first(start, mask, states)[1:]
    layers = len(past) // 4  # key and value of the own and the cross cache, per layer
    own_presents = {"logits": ROWS} | _each(_names("present", layers, ".decoder"), PRESENT)
    _export(
        first,
        (start, mask, states),
        out_dir / DECODER,
        {
            "input_ids": ROWS,
            "encoder_attention_mask": ROWS_BY_SOURCE,
            "encoder_hidden_states": ROWS_BY_SOURCE,
        },
        own_presents | _each(_names("present", layers, ".encoder"), CROSS),
    )
    # Two cached decoder positions, the first of them padding in row 0, plus the new token.
    decoder_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.long)
    own = [torch.cat([tensor, tensor], dim=2) for tensor in past[: 2 * layers]]
    step_inputs = {
        "input_ids": ROWS,
        "decoder_attention_mask": ROWS_BY_TOTAL,
        "encoder_attention_mask": ROWS_BY_SOURCE,
    }
    _export(
        _Seq2SeqStep(model, layers),
        (start, decoder_mask, mask, *own, *past[2 * layers :]),
        out_dir / DECODER_WITH_PAST,
        step_inputs
        | _each(_names("past_key_values", layers, ".decoder"), PAST)
        | _each(_names("past_key_values", layers, ".encoder"), CROSS),
        own_presents,
    )


def export(
    model_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> Path:
    """Write this engine's ONNX graphs for the model at `model_path` into `out_dir`."""
    model_config = AutoConfig.from_pretrained(
        model_path, trust_remote_code=trust_remote_code, local_files_only=True
    )
    model = (
        auto_model_class(model_config)
        .from_pretrained(
            model_path,
            dtype=dtype,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            # Eager attention applies the mask explicitly, so the traced graph honours padding.
            attn_implementation="eager",
        )
        .eval()
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    if model_config.is_encoder_decoder:
        _export_seq2seq(model, out_dir)
    else:
        _export_causal(model, out_dir)
    logger.info(f"Exported {model_config.model_type} from {model_path} to ONNX in {out_dir}")
    return out_dir


def _cache_key(model_path: Path, dtype: torch.dtype) -> str:
    files = sorted(p for p in model_path.iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
    facts = {
        "format": FORMAT_VERSION,
        "path": str(model_path.resolve()),
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "dtype": str(dtype),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def _present(directory: Path, is_encoder_decoder: bool) -> bool:
    return all((directory / name).is_file() for name in _graph_files(is_encoder_decoder))


def onnx_dir(config: EngineConfig, is_encoder_decoder: bool, dtype: torch.dtype) -> Path:
    """Graphs shipped with the model (its dir or `onnx/`), else an export cached by model identity."""
    for candidate in (config.model_path, config.model_path / "onnx"):
        if _present(candidate, is_encoder_decoder):
            logger.info(f"Using the ONNX graphs in {candidate}")
            return candidate
    root = config.cache_dir or Path(tempfile.gettempdir()) / "tgis-onnx"
    target = root / _cache_key(config.model_path, dtype)
    if _present(target, is_encoder_decoder):
        logger.info(f"Using the cached ONNX export in {target}")
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="export-", dir=root))
    try:
        export(config.model_path, staging, dtype, config.trust_remote_code)
        try:
            os.replace(staging, target)  # atomic: a concurrent exporter's result is just as good
        except OSError:
            if not _present(target, is_encoder_decoder):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---- running ------------------------------------------------------------------------------------------


class _Graph:
    """One ONNX Runtime session fed from and returning torch tensors."""

    def __init__(self, path: Path, providers: list[str], options: ort.SessionOptions) -> None:
        self.session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Exports drop inputs a model ignores (bloom takes no position ids), so feed only known ones.
        arrays = {name: np.ascontiguousarray(t.numpy()) for name, t in feeds.items() if name in self.inputs}
        return {
            name: torch.from_numpy(value)
            for name, value in zip(self.outputs, self.session.run(None, arrays), strict=True)
        }


@dataclass
class _Batch:
    """The running rows; every tensor's first dim is the row."""

    past: list[torch.Tensor]  # flat key, value per layer: [B, heads, T, head_dim], left-padded
    attention_mask: torch.Tensor  # [B, T] over cached decoder positions
    next_positions: torch.Tensor  # [B]
    cross: list[torch.Tensor] | None = None  # encoder-decoder: [B, heads, S, head_dim], right-padded
    encoder_mask: torch.Tensor | None = None  # [B, S]

    @property
    def rows(self) -> int:
        return int(self.attention_mask.shape[0])

    def merge(self, new: _Batch) -> None:
        """Append `new`'s rows, left-padding the shorter decoder cache (and right-padding sources)."""
        length = max(self.attention_mask.shape[1], new.attention_mask.shape[1])
        self.past = [
            torch.cat([left_pad(a, length, 2), left_pad(b, length, 2)])
            for a, b in zip(self.past, new.past, strict=True)
        ]
        self.attention_mask = torch.cat(
            [left_pad(self.attention_mask, length, 1), left_pad(new.attention_mask, length, 1)]
        )
        self.next_positions = torch.cat([self.next_positions, new.next_positions])
        if self.cross is not None and new.cross is not None:
            assert self.encoder_mask is not None and new.encoder_mask is not None
            source = max(self.encoder_mask.shape[1], new.encoder_mask.shape[1])
            self.cross = [
                torch.cat([right_pad(a, source, 2), right_pad(b, source, 2)])
                for a, b in zip(self.cross, new.cross, strict=True)
            ]
            self.encoder_mask = torch.cat(
                [right_pad(self.encoder_mask, source, 1), right_pad(new.encoder_mask, source, 1)]
            )

    def select(self, indices: torch.Tensor) -> None:
        """Keep `indices` rows, then drop cache columns that are padding in every remaining row."""
        mask = self.attention_mask[indices]
        live = mask.any(dim=0).nonzero()
        start = int(live[0]) if live.numel() else mask.shape[1]
        self.attention_mask = mask[:, start:]
        self.next_positions = self.next_positions[indices]
        self.past = [tensor[indices, :, start:] for tensor in self.past]
        if self.cross is not None and self.encoder_mask is not None:
            self.cross = [tensor[indices] for tensor in self.cross]
            self.encoder_mask = self.encoder_mask[indices]


class OrtEngine:
    """ONNX Runtime sessions plus the running batch and its KV cache."""

    def __init__(
        self, graphs: dict[str, _Graph], spec: EngineSpec, decoder_start_token_id: int | None
    ) -> None:
        self.graphs = graphs
        self.spec = spec
        self._start = decoder_start_token_id
        self._batch: _Batch | None = None
        self._layers = sum(1 for name in graphs[DECODER_WITH_PAST].inputs if name.endswith(".key")) // (
            2 if spec.is_encoder_decoder else 1
        )

    @property
    def num_rows(self) -> int:
        return 0 if self._batch is None else self._batch.rows

    def clear(self) -> None:
        self._batch = None

    def prefill(self, rows: Sequence[PrefillRow]) -> PrefillResult:
        ids, mask = left_padded_inputs(rows, self.spec.pad_token_id, torch.device("cpu"))
        if self.spec.is_encoder_decoder:
            new, logits = self._prefill_seq2seq(ids, mask)
            prompt_logits: list[torch.Tensor | None] = [None] * len(rows)
        else:
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
            out = self.graphs[DECODER]({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
            all_logits = out["logits"].float()
            logits = all_logits[:, -1, :]
            prompt_logits = [
                all_logits[i, ids.shape[1] - len(row.input_ids) :] if row.want_prompt_logits else None
                for i, row in enumerate(rows)
            ]
            new = _Batch(past=self._presents(out), attention_mask=mask, next_positions=positions[:, -1] + 1)
        if self._batch is None:
            self._batch = new
        else:
            self._batch.merge(new)
        return PrefillResult(next_token_logits=logits, prompt_logits=prompt_logits)

    def _presents(self, out: dict[str, torch.Tensor], part: str = "") -> list[torch.Tensor]:
        return [out[name] for name in _names("present", self._layers, part)]

    def _prefill_seq2seq(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[_Batch, torch.Tensor]:
        states = self.graphs[ENCODER]({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
        start = torch.full((ids.shape[0], 1), self._start or 0, dtype=torch.long)
        out = self.graphs[DECODER](
            {"input_ids": start, "encoder_attention_mask": mask, "encoder_hidden_states": states}
        )
        batch = _Batch(
            past=self._presents(out, ".decoder"),
            attention_mask=torch.ones_like(start),
            next_positions=torch.ones(ids.shape[0], dtype=torch.long),
            cross=self._presents(out, ".encoder"),
            encoder_mask=mask,
        )
        return batch, out["logits"][:, -1, :].float()

    def decode(self, token_ids: Sequence[int]) -> torch.Tensor:
        batch = self._batch
        if batch is None or batch.rows != len(token_ids):
            raise RuntimeError(f"decode got {len(token_ids)} tokens for {self.num_rows} rows")
        ids = torch.tensor(list(token_ids), dtype=torch.long)[:, None]
        batch.attention_mask = torch.cat([batch.attention_mask, torch.ones_like(ids)], dim=1)
        if self.spec.is_encoder_decoder:
            assert batch.cross is not None and batch.encoder_mask is not None
            feeds = {
                "input_ids": ids,
                "decoder_attention_mask": batch.attention_mask,
                "encoder_attention_mask": batch.encoder_mask,
            }
            feeds |= dict(zip(_names("past_key_values", self._layers, ".decoder"), batch.past, strict=True))
            feeds |= dict(zip(_names("past_key_values", self._layers, ".encoder"), batch.cross, strict=True))
            out = self.graphs[DECODER_WITH_PAST](feeds)
            batch.past = self._presents(out, ".decoder")
        else:
            feeds = {
                "input_ids": ids,
                "attention_mask": batch.attention_mask,
                "position_ids": batch.next_positions[:, None],
            }
            feeds |= dict(zip(_names("past_key_values", self._layers), batch.past, strict=True))
            out = self.graphs[DECODER_WITH_PAST](feeds)
            batch.past = self._presents(out)
        batch.next_positions = batch.next_positions + 1
        return out["logits"][:, -1, :].float()

    def keep_rows(self, indices: Sequence[int]) -> None:
        if self._batch is None:
            return
        if not indices:
            self._batch = None
            return
        if list(indices) == list(range(self._batch.rows)):
            return
        self._batch.select(torch.tensor(list(indices), dtype=torch.long))

    def unload_lora(self, adapter_id: str) -> None:
        """Nothing to free: this engine loads no LoRA adapters (spec.supports_lora is False)."""


def _providers(device: str | None) -> tuple[list[str], bool]:
    """CUDA when asked for or available (and this onnxruntime build has it), else CPU."""
    available = ort.get_available_providers()
    wants_cuda = device.startswith("cuda") if device else "CUDAExecutionProvider" in available
    if wants_cuda and "CUDAExecutionProvider" not in available:
        raise ValueError("DEPLOYMENT_FRAMEWORK hf_optimum_ort: this onnxruntime build has no CUDA provider")
    return (
        (["CUDAExecutionProvider", "CPUExecutionProvider"], True)
        if wants_cuda
        else (["CPUExecutionProvider"], False)
    )


def load(config: EngineConfig) -> OrtEngine:
    if config.num_shards > 1:
        raise ValueError(f"hf_optimum_ort runs on one device; it cannot use {config.num_shards} shards")
    providers, cuda = _providers(config.device)
    # Logits come back to the CPU either way; the dtype default follows the execution device.
    dtype = resolve_dtype(config.dtype, torch.device("cuda" if cuda else "cpu"))
    model_config = AutoConfig.from_pretrained(
        config.model_path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    auto_model_class(model_config)
    is_encoder_decoder = bool(model_config.is_encoder_decoder)
    directory = onnx_dir(config, is_encoder_decoder, dtype)
    options = ort.SessionOptions()
    # SPEC §7: O3 on GPU, O1 on CPU.
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if cuda else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    )
    graphs = {name: _Graph(directory / name, providers, options) for name in _graph_files(is_encoder_decoder)}
    eos_ids = config_eos_token_ids(model_config)
    pad = model_config.pad_token_id
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    logits_shape = graphs[DECODER].session.get_outputs()[0].shape
    vocab = logits_shape[-1] if isinstance(logits_shape[-1], int) else model_config.vocab_size
    spec = EngineSpec(
        is_encoder_decoder=is_encoder_decoder,
        vocab_size=int(vocab),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad),
        device=torch.device("cpu"),
        dtype=dtype,
        model_config=json.loads(model_config.to_json_string()),
        supports_prefixes=False,
        supports_lora=False,
        engine_name="hf_optimum_ort",
    )
    logger.info(f"Loaded {model_config.model_type} on ONNX Runtime ({providers[0]}) from {directory}")
    return OrtEngine(graphs, spec, getattr(model_config, "decoder_start_token_id", None))


def main(argv: list[str] | None = None) -> int:
    """`python -m engines.hf_optimum_ort MODEL_DIR [--out DIR]`: export ahead of time."""
    parser = argparse.ArgumentParser(prog="python -m engines.hf_optimum_ort")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, help="default: MODEL_DIR/onnx, where the engine looks first")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    export(
        args.model_dir,
        args.out or args.model_dir / "onnx",
        resolve_dtype(args.dtype, torch.device("cpu")),
    )
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
