"""The ONNX layout this engine exports and runs: optimum's non-merged graph files and I/O tensor names."""

from __future__ import annotations

ENCODER = "encoder_model.onnx"
DECODER = "decoder_model.onnx"
DECODER_WITH_PAST = "decoder_with_past_model.onnx"


def graph_files(is_encoder_decoder: bool) -> tuple[str, ...]:
    return (ENCODER, DECODER, DECODER_WITH_PAST) if is_encoder_decoder else (DECODER, DECODER_WITH_PAST)


def cache_names(prefix: str, layers: int, part: str = "") -> list[str]:
    """Key and value tensor names per layer: `present.0.key`, `past_key_values.1.decoder.value`..."""
    return [f"{prefix}.{i}{part}.{kind}" for i in range(layers) for kind in ("key", "value")]
