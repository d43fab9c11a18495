"""The ONNX Runtime engine: its sessions plus a left-padded running batch with its KV cache as tensors,
merged and pruned exactly as in hf_transformers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from engines.base import EngineSpec, PrefillResult, PrefillRow
from engines.common import left_pad, left_padded_inputs, right_pad
from engines.hf_optimum_ort.layout import DECODER, DECODER_WITH_PAST, ENCODER, cache_names


class Graph:
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
class OrtBatch:
    """The running rows; every tensor's first dim is the row."""

    past: list[torch.Tensor]  # flat key, value per layer: [B, heads, T, head_dim], left-padded
    attention_mask: torch.Tensor  # [B, T] over cached decoder positions
    next_positions: torch.Tensor  # [B]
    cross: list[torch.Tensor] | None = None  # encoder-decoder: [B, heads, S, head_dim], right-padded
    encoder_mask: torch.Tensor | None = None  # [B, S]

    @property
    def rows(self) -> int:
        return int(self.attention_mask.shape[0])

    def merge(self, new: OrtBatch) -> None:
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
        self, graphs: dict[str, Graph], spec: EngineSpec, decoder_start_token_id: int | None
    ) -> None:
        self.graphs = graphs
        self.spec = spec
        self._start = decoder_start_token_id
        self._batch: OrtBatch | None = None
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
            new, logits, prompt_logits = self._prefill_causal(rows, ids, mask)
        if self._batch is None:
            self._batch = new
        else:
            self._batch.merge(new)
        return PrefillResult(next_token_logits=logits, prompt_logits=prompt_logits)

    def _presents(self, out: dict[str, torch.Tensor], part: str = "") -> list[torch.Tensor]:
        return [out[name] for name in cache_names("present", self._layers, part)]

    def _prefill_causal(
        self, rows: Sequence[PrefillRow], ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[OrtBatch, torch.Tensor, list[torch.Tensor | None]]:
        """The decoder graph over the prompts: their batch, next-token and (where asked) prompt logits."""
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self.graphs[DECODER]({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
        all_logits = out["logits"].float()
        prompt_logits: list[torch.Tensor | None] = [
            all_logits[i, ids.shape[1] - len(row.input_ids) :] if row.want_prompt_logits else None
            for i, row in enumerate(rows)
        ]
        batch = OrtBatch(past=self._presents(out), attention_mask=mask, next_positions=positions[:, -1] + 1)
        return batch, all_logits[:, -1, :], prompt_logits

    def _prefill_seq2seq(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[OrtBatch, torch.Tensor]:
        states = self.graphs[ENCODER]({"input_ids": ids, "attention_mask": mask})["last_hidden_state"]
        start = torch.full((ids.shape[0], 1), self._start or 0, dtype=torch.long)
        out = self.graphs[DECODER](
            {"input_ids": start, "encoder_attention_mask": mask, "encoder_hidden_states": states}
        )
        batch = OrtBatch(
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
        out = self.graphs[DECODER_WITH_PAST](self._decode_feeds(batch, ids))
        batch.past = self._presents(out, ".decoder" if self.spec.is_encoder_decoder else "")
        batch.next_positions = batch.next_positions + 1
        return out["logits"][:, -1, :].float()

    def _decode_feeds(self, batch: OrtBatch, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The with-past graph's inputs: one new token per row, the masks, and the caches by name."""
        if self.spec.is_encoder_decoder:
            assert batch.cross is not None and batch.encoder_mask is not None
            feeds = {
                "input_ids": ids,
                "decoder_attention_mask": batch.attention_mask,
                "encoder_attention_mask": batch.encoder_mask,
            }
            feeds |= dict(
                zip(cache_names("past_key_values", self._layers, ".decoder"), batch.past, strict=True)
            )
            feeds |= dict(
                zip(cache_names("past_key_values", self._layers, ".encoder"), batch.cross, strict=True)
            )
            return feeds
        feeds = {
            "input_ids": ids,
            "attention_mask": batch.attention_mask,
            "position_ids": batch.next_positions[:, None],
        }
        feeds |= dict(zip(cache_names("past_key_values", self._layers), batch.past, strict=True))
        return feeds

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
