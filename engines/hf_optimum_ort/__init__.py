"""Runs ONNX exports of a transformers model on ONNX Runtime over a left-padded batch with its KV cache.

`exporter` traces the graphs (optimum's non-merged layout, `layout`) from the `traced` modules and is
the `python -m engines.hf_optimum_ort` CLI; `loading` finds or exports the graphs and opens the
sessions; `engine` runs them over the running batch. onnxruntime is the optional `ort` extra: the
registry imports this package only when DEPLOYMENT_FRAMEWORK names it.
"""

from engines.hf_optimum_ort.engine import OrtEngine
from engines.hf_optimum_ort.exporter import export, main
from engines.hf_optimum_ort.layout import DECODER, DECODER_WITH_PAST, ENCODER
from engines.hf_optimum_ort.loading import load, onnx_dir

__all__ = ["DECODER", "DECODER_WITH_PAST", "ENCODER", "OrtEngine", "export", "load", "main", "onnx_dir"]
