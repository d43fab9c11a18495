"""TGIS settings this server accepts but does not implement: each one set gets one warning naming
its effect here, so no TGIS setting is silently a no-op."""

from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)


# TGIS variable -> what setting it does here (the sentence ends the warning).
UNIMPLEMENTED_TGIS_SETTINGS: dict[str, str] = {
    "GPTQ_CUDA_TYPE": "GPTQ checkpoints are read into this server's own int4 layers (no CUDA kernel choice)",
    "EXLLAMA_VERSION": "the GPTQ kernel is the one transformers picks (no Exllama selection)",
    "DISABLE_EXLLAMA": "the GPTQ kernel is the one transformers picks (no Exllama selection)",
    "FP32_LOGITS_PROCESS": "logits are processed in the model's dtype, not cast to float32",
    "LOG_GPU_USAGE_INTERVAL": "GPU usage is not logged periodically; see the tgi_* metrics on /metrics",
    "CUDA_PAD_TO_MULT_OF_8": "padded batches are not padded to a multiple of 8",
    "COMPACT_BEFORE_PREFILL": "the batch is not compacted before a prefill",
    "BLOOM_SLOW_BUT_EXACT": "bloom runs transformers' default implementation",
    "OPTIMIZE_ONNX_MODEL": "ONNX models are not optimised at export",
    "MERGE_ONNX_GRAPHS": "ONNX graphs are not merged at export",
    "DISABLE_CUSTOM_KERNELS": "there are no custom CUDA kernels to disable",
    "DEBUG": "shards always talk over torch.distributed (there is no single-process debug group)",
    # TGIS's launcher sets these for each shard process it starts; set by an operator they mean nothing.
    "RANK": "the launcher starts the shard processes itself; NUM_GPUS or NUM_SHARD sets their count",
    "WORLD_SIZE": "the launcher starts the shard processes itself; NUM_GPUS or NUM_SHARD sets their count",
}


def unimplemented_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The unimplemented TGIS variables set (non-empty) in `environ`, each with its effect here."""
    return {name: effect for name, effect in UNIMPLEMENTED_TGIS_SETTINGS.items() if environ.get(name)}


def warn_unimplemented(environ: Mapping[str, str]) -> None:
    """One WARNING per unimplemented TGIS variable set."""
    for name, effect in unimplemented_settings(environ).items():
        logger.warning(f"{name}={environ[name]} is accepted but not implemented by this server: {effect}")
