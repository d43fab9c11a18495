"""Loading the ONNX Runtime engine: which graphs (shipped, cached or exported now), which provider,
and the sessions' settings."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import onnxruntime as ort
import torch
import transformers
from transformers import AutoConfig

from engines.base import EngineConfig, EngineSpec
from engines.common import auto_model_class, config_eos_token_ids, resolve_dtype
from engines.hf_optimum_ort.engine import Graph, OrtEngine
from engines.hf_optimum_ort.exporter import export
from engines.hf_optimum_ort.layout import DECODER, graph_files

# Loading logs under the engine's name, as it did before the engine became a package.
logger = logging.getLogger("engines.hf_optimum_ort")

FORMAT_VERSION = 1


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
    return all((directory / name).is_file() for name in graph_files(is_encoder_decoder))


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


def _session_options(cuda: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    # SPEC §7: O3 on GPU, O1 on CPU.
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if cuda else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    )
    return options


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
    options = _session_options(cuda)
    graphs = {name: Graph(directory / name, providers, options) for name in graph_files(is_encoder_decoder)}
    spec = _spec(model_config, graphs[DECODER], dtype, config.model_path)
    logger.info(f"Loaded {model_config.model_type} on ONNX Runtime ({providers[0]}) from {directory}")
    return OrtEngine(graphs, spec, getattr(model_config, "decoder_start_token_id", None))


def _spec(
    model_config: transformers.PretrainedConfig, decoder: Graph, dtype: torch.dtype, model_path: Path
) -> EngineSpec:
    eos_ids = config_eos_token_ids(model_config, model_path)
    pad = model_config.pad_token_id
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    # The vocabulary is the exported logits' width, where the graph fixes it.
    logits_shape = decoder.session.get_outputs()[0].shape
    vocab = logits_shape[-1] if isinstance(logits_shape[-1], int) else model_config.vocab_size
    return EngineSpec(
        is_encoder_decoder=bool(model_config.is_encoder_decoder),
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
