"""The default engine: an AutoModelForCausalLM / AutoModelForSeq2SeqLM on one device, paged or padded.

`loading` picks the engine, `engine` runs the padded batch, `batch` merges and prunes its KV cache,
`prefill_chunks` cuts a prefill group into low-padding passes.
"""

from engines.hf_transformers.engine import HFTransformersEngine
from engines.hf_transformers.loading import load, load_padded
from engines.hf_transformers.prefill_chunks import (
    PREFILL_CHUNK_MAX_PADDING,
    PREFILL_CHUNK_MAX_POSITIONS,
    prefill_chunks,
)

__all__ = [
    "PREFILL_CHUNK_MAX_PADDING",
    "PREFILL_CHUNK_MAX_POSITIONS",
    "HFTransformersEngine",
    "load",
    "load_padded",
    "prefill_chunks",
]
