"""Exporting a transformers model into this engine's ONNX graphs with torch.onnx, and its CLI.

optimum's ORT integration (optimum-onnx) pins transformers < 4.58, so the graphs are traced here, in
optimum's non-merged layout and I/O naming: a graph without past (prefill), a graph with past (one
token per row) and, for encoder-decoder models, an encoder.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from engines.common import auto_model_class, resolve_dtype
from engines.hf_optimum_ort.layout import DECODER, DECODER_WITH_PAST, ENCODER, cache_names
from engines.hf_optimum_ort.traced import CausalStep, Encoder, Seq2SeqFirstStep, Seq2SeqStep

# Export logs under the engine's name, as they did before the engine became a package.
logger = logging.getLogger("engines.hf_optimum_ort")

OPSET = 17

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
    step = CausalStep(model, "position_ids" in inspect.signature(model.forward).parameters)
    ids = torch.full((2, 6), 5, dtype=torch.long)
    mask = _example_mask(2, 6)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    presents = {"logits": ROWS_BY_SEQUENCE} | _each(cache_names("present", layers), PRESENT)
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
        one_token | _each(cache_names("past_key_values", layers), PAST),
        presents | {"logits": ROWS},
    )


def _export_seq2seq(model: Any, out_dir: Path) -> None:
    """The encoder, then the decoder's first step (which fills the cross cache), then its next steps;
    each traced on what the one before computes from the example inputs."""
    ids = torch.full((2, 6), 5, dtype=torch.long)
    mask = _example_mask(2, 6)
    states = _export_encoder(model, ids, mask, out_dir)
    start = torch.full((2, 1), model.config.decoder_start_token_id, dtype=torch.long)
    past = _export_first_decoder_step(model, start, mask, states, out_dir)
    _export_next_decoder_step(model, start, mask, past, out_dir)


def _export_encoder(model: Any, ids: torch.Tensor, mask: torch.Tensor, out_dir: Path) -> torch.Tensor:
    """Export the encoder; its hidden states on `ids`."""
    encoder = Encoder(model)
    source = {"input_ids": ROWS_BY_SOURCE, "attention_mask": ROWS_BY_SOURCE}
    _export(encoder, (ids, mask), out_dir / ENCODER, source, {"last_hidden_state": ROWS_BY_SOURCE})
    with torch.no_grad():
        return encoder(ids, mask)


def _decoder_presents(layers: int) -> dict[str, Axes]:
    """The outputs of every decoder step: logits and the self-attention cache."""
    return {"logits": ROWS} | _each(cache_names("present", layers, ".decoder"), PRESENT)


def _export_first_decoder_step(
    model: Any, start: torch.Tensor, mask: torch.Tensor, states: torch.Tensor, out_dir: Path
) -> tuple[torch.Tensor, ...]:
    """Export the decoder graph without past; its caches (own, then cross) after the start token."""
    first = Seq2SeqFirstStep(model)
    with torch.no_grad():
        past = first(start, mask, states)[1:]
    layers = len(past) // 4  # key and value of the own and the cross cache, per layer
    _export(
        first,
        (start, mask, states),
        out_dir / DECODER,
        {
            "input_ids": ROWS,
            "encoder_attention_mask": ROWS_BY_SOURCE,
            "encoder_hidden_states": ROWS_BY_SOURCE,
        },
        _decoder_presents(layers) | _each(cache_names("present", layers, ".encoder"), CROSS),
    )
    return past


def _export_next_decoder_step(
    model: Any, start: torch.Tensor, mask: torch.Tensor, past: tuple[torch.Tensor, ...], out_dir: Path
) -> None:
    """Export the decoder graph with past: one token per row over the own and the cross cache."""
    layers = len(past) // 4
    # Two cached decoder positions, the first of them padding in row 0, plus the new token.
    decoder_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.long)
    own = [torch.cat([tensor, tensor], dim=2) for tensor in past[: 2 * layers]]
    step_inputs = {
        "input_ids": ROWS,
        "decoder_attention_mask": ROWS_BY_TOTAL,
        "encoder_attention_mask": ROWS_BY_SOURCE,
    }
    _export(
        Seq2SeqStep(model, layers),
        (start, decoder_mask, mask, *own, *past[2 * layers :]),
        out_dir / DECODER_WITH_PAST,
        step_inputs
        | _each(cache_names("past_key_values", layers, ".decoder"), PAST)
        | _each(cache_names("past_key_values", layers, ".encoder"), CROSS),
        _decoder_presents(layers),
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
