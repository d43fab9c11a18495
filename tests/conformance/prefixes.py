"""The conformance prefix store (SPEC §8, §14): which prompt-tuning prefixes the suite's servers can load.

Every suite server gets the same `PREFIX_STORE_PATH`, as the TGIS harness has it. The entries cover
SPEC §14's layouts: on gpt2 (decoder-only) a raw `decoder.pt`, a nested id and PEFT prompt tuning
saved as safetensors and as `.bin`; on t5 (encoder-decoder) raw encoder-only, decoder-only and both.
The embeddings are seeded rows of the model's own input embedding plus a little noise, so they steer
the output without swamping it. The row counts are facts the cases quote in their messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tests.conformance.oracle import Prefix, Reference
from tests.fixtures.adapters import write_peft_prompt_tuning, write_raw_prefix

NOISE = 0.1  # spread of the noise added to the sampled embedding rows


@dataclass(frozen=True)
class Entry:
    """One store entry: its model, file layout, seed and virtual-token rows."""

    model: str
    layout: Literal["raw", "peft_safetensors", "peft_bin"]
    seed: int
    decoder_rows: int = 0
    encoder_rows: int = 0


ENTRIES: dict[str, Entry] = {
    "gpt2_plain": Entry("gpt2", "raw", seed=1, decoder_rows=4),
    "nested/path": Entry("gpt2", "raw", seed=2, decoder_rows=3),
    "gpt2_peft_safetensors": Entry("gpt2", "peft_safetensors", seed=3, decoder_rows=5),
    "gpt2_peft_bin": Entry("gpt2", "peft_bin", seed=4, decoder_rows=2),
    # Encoder-decoder decoder prefixes must have an even number of rows (SPEC §8 checks).
    "t5/encoder": Entry("t5", "raw", seed=5, encoder_rows=4),
    "t5/decoder": Entry("t5", "raw", seed=6, decoder_rows=2),
    "t5/both": Entry("t5", "raw", seed=7, encoder_rows=4, decoder_rows=2),
}


def embeddings(ref: Reference, rows: int, seed: int) -> torch.Tensor | None:
    """`rows` seeded rows of the model's input embedding plus noise: [rows, hidden], float32."""
    if rows == 0:
        return None
    generator = torch.Generator().manual_seed(seed)
    weight = ref.model.get_input_embeddings().weight.detach().float()
    picked = weight[torch.randint(0, weight.shape[0], (rows,), generator=generator)]
    return picked + NOISE * torch.randn(rows, weight.shape[1], generator=generator)


def build_store(store: Path, refs: Mapping[str, Reference]) -> dict[str, dict[str, Prefix]]:
    """Write every entry under `store`; returns model name → prefix id → what the oracle prepends."""
    prefixes: dict[str, dict[str, Prefix]] = {name: {} for name in refs}
    for prefix_id, entry in ENTRIES.items():
        ref = refs[entry.model]
        # Distinct seeds for the two halves of an encoder-decoder entry.
        decoder = embeddings(ref, entry.decoder_rows, entry.seed)
        encoder = embeddings(ref, entry.encoder_rows, 1000 + entry.seed)
        if entry.layout == "raw":
            write_raw_prefix(store, prefix_id, decoder=decoder, encoder=encoder)
        else:
            if decoder is None or encoder is not None:
                raise ValueError(f"{prefix_id}: PEFT prompt tuning here is for decoder-only models")
            fmt: Literal["safetensors", "bin"] = (
                "safetensors" if entry.layout == "peft_safetensors" else "bin"
            )
            write_peft_prompt_tuning(store, prefix_id, decoder, fmt=fmt)
        prefixes[entry.model][prefix_id] = Prefix(prefix_id, decoder=decoder, encoder=encoder)
    return prefixes
