"""The padded engine: one transformers model over a left-padded running batch with its KV cache.

Rows may carry a prompt-tuning prefix (spliced in as input embeddings) or a LoRA adapter (peft's
mixed-adapter batches, see engines/lora.py), freely mixed in one batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import transformers
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache

from engines.base import EngineSpec, PrefillResult, PrefillRow
from engines.common import PaddedInputs, cache_keyword, prefixed_inputs, prefixed_length, returned_cache
from engines.compiled import CompiledForward
from engines.hf_transformers.batch import PaddedBatch, merge, select
from engines.hf_transformers.prefill_chunks import prefill_chunks
from engines.kv_cache import GrowingCache
from engines.lora import LoraAdapters

# What one forward pass over new rows gives: their batch, next-token logits, and prompt logits per row.
PrefilledRows = tuple[PaddedBatch, torch.Tensor, list[torch.Tensor | None]]


def _input_prefix(row: PrefillRow, is_encoder_decoder: bool) -> torch.Tensor | None:
    """The prefix rows in front of the row's input ids: the encoder prefix of encoder-decoder models,
    the decoder prefix of decoder-only ones."""
    if row.prefix is None:
        return None
    return row.prefix.encoder if is_encoder_decoder else row.prefix.decoder


class HFTransformersEngine:
    """One transformers model on one device; the running batch and its KV cache live here."""

    def __init__(self, model: transformers.PreTrainedModel, spec: EngineSpec) -> None:
        self.model = model
        self.spec = spec
        self._batch: PaddedBatch | None = None
        parameters = inspect.signature(model.forward).parameters
        self._takes_position_ids = "position_ids" in parameters
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        self._cache_keyword = cache_keyword(model)
        # Appending in place saves a cache copy per step; compiled graphs trace the plain layer instead.
        compiled = isinstance(model.forward, CompiledForward)
        self._new_cache: Callable[[], Cache] = DynamicCache if compiled else GrowingCache
        self._row_loras: list[str | None] = []  # LoRA adapter id of each running row, in row order
        self._loras: LoraAdapters | None = None  # created with the first LoRA row
        self._unload_pending: set[str] = set()  # unload_lora ids still used by a running row

    @property
    def num_rows(self) -> int:
        return 0 if self._batch is None else self._batch.rows

    @property
    def loras(self) -> LoraAdapters | None:
        """The LoRA adapters loaded into the model; None until the first LoRA row."""
        return self._loras

    def clear(self) -> None:
        self._batch = None
        self._row_loras = []
        self._unload_unused()

    # ---- LoRA adapters

    def unload_lora(self, adapter_id: str) -> None:
        """Delete the adapter from the model now, or once no running row uses it (keep_rows/clear).

        A later prefill row with this id cancels a deferred unload; one after the unload reloads it.
        """
        if self._loras is None or adapter_id not in self._loras.loaded:
            return
        self._unload_pending.add(adapter_id)
        self._unload_unused()

    def _unload_unused(self) -> None:
        if not self._unload_pending or self._loras is None:
            return
        for adapter_id in self._unload_pending - set(self._row_loras):
            self._loras.unload(adapter_id)
            self._unload_pending.discard(adapter_id)

    def _adapters(self, row_loras: Sequence[str | None]) -> contextlib.AbstractContextManager[None]:
        """Where model calls must run so that row i uses adapter row_loras[i] (or none)."""
        if self._loras is None or not self._loras.wrapped:
            return contextlib.nullcontext()
        return self._loras.forward_context(row_loras)

    def _load_loras(self, rows: Sequence[PrefillRow]) -> list[str | None]:
        """Load the adapters new rows use (before the batch changes); their ids in row order."""
        ids: list[str | None] = []
        for row in rows:
            if row.lora is None:
                ids.append(None)
                continue
            if not self.spec.supports_lora:
                raise ValueError("this engine does not serve LoRA adapters")
            if self._loras is None:
                self._loras = LoraAdapters(self.model, self.spec.device)
            self._loras.load(row.lora)
            self._unload_pending.discard(row.lora.adapter_id)
            ids.append(row.lora.adapter_id)
        return ids

    # ---- prefill

    def prefill(self, rows: Sequence[PrefillRow]) -> PrefillResult:
        """Append `rows` to the running batch; a group of very different lengths runs as several
        forward passes over rows of similar length (less padding), merged back in the given order."""
        # Outside inference mode: adapter weights made there could not be touched by peft later on.
        row_loras = self._load_loras(rows)
        first_new_row = self.num_rows
        encoder_decoder = self.spec.is_encoder_decoder
        chunks = prefill_chunks(
            [prefixed_length(row.input_ids, _input_prefix(row, encoder_decoder)) for row in rows]
        )
        logits: list[torch.Tensor] = []
        prompt_logits: list[torch.Tensor | None] = [None] * len(rows)
        for chunk in chunks:
            chunk_logits, chunk_prompt = self._prefill_chunk(
                [rows[i] for i in chunk], [row_loras[i] for i in chunk]
            )
            logits.append(chunk_logits)
            for i, row_prompt in zip(chunk, chunk_prompt, strict=True):
                prompt_logits[i] = row_prompt
        next_token_logits = self._restore_given_order(first_new_row, chunks, torch.cat(logits))
        return PrefillResult(next_token_logits=next_token_logits, prompt_logits=prompt_logits)

    def _prefill_chunk(
        self, rows: Sequence[PrefillRow], row_loras: list[str | None]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One forward pass over `rows`, appended to the running batch: (next-token, prompt) logits."""
        with torch.inference_mode(), self._adapters(row_loras):
            if self.spec.is_encoder_decoder:
                new_batch, logits, prompt_logits = self._prefill_encoder_decoder(rows)
            else:
                new_batch, logits, prompt_logits = self._prefill_decoder_only(rows)
        self._batch = new_batch if self._batch is None else merge(self._batch, new_batch)
        self._row_loras = self._row_loras + row_loras
        return logits, prompt_logits

    def _restore_given_order(
        self, first_new_row: int, chunks: list[list[int]], logits: torch.Tensor
    ) -> torch.Tensor:
        """Reorder the rows the chunks appended (in chunk order) into the order they were given, and
        their next-token logits with them."""
        order = [i for chunk in chunks for i in chunk]
        if order == list(range(len(order))):
            return logits
        position = {row: k for k, row in enumerate(order)}
        given_order = [position[i] for i in range(len(order))]
        self.keep_rows([*range(first_new_row), *(first_new_row + k for k in given_order)])
        return logits[given_order]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.model.get_input_embeddings()(ids))

    def _ids_or_embeds(self, inputs: PaddedInputs, role: str = "") -> dict[str, torch.Tensor]:
        """`{role}input_ids`, or `{role}inputs_embeds` when some row carries prefix embeddings."""
        if inputs.has_prefix:
            return {f"{role}inputs_embeds": inputs.embeddings(self._embed)}
        return {f"{role}input_ids": inputs.ids}

    def _prefill_decoder_only(self, rows: Sequence[PrefillRow]) -> PrefilledRows:
        prefixes = [_input_prefix(row, is_encoder_decoder=False) for row in rows]
        inputs = prefixed_inputs(
            [row.input_ids for row in rows], prefixes, self.spec.pad_token_id, self.spec.device
        )
        mask = inputs.mask
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        want_prompt = any(row.want_prompt_logits for row in rows)
        kwargs: dict[str, Any] = self._ids_or_embeds(inputs)
        if self._takes_position_ids:
            kwargs["position_ids"] = positions
        if self._takes_logits_to_keep and not want_prompt:
            kwargs["logits_to_keep"] = 1
        kwargs[self._cache_keyword] = self._new_cache()
        out = self.model(attention_mask=mask, use_cache=True, **kwargs)
        logits = out.logits.float()
        width = mask.shape[1]
        prompt_logits: list[torch.Tensor | None] = [
            logits[i, width - length :] if row.want_prompt_logits else None
            for i, (row, length) in enumerate(zip(rows, inputs.lengths, strict=True))
        ]
        batch = PaddedBatch(
            cache=returned_cache(out), attention_mask=mask, next_positions=positions[:, -1] + 1
        )
        return batch, logits[:, -1, :], prompt_logits

    def _prefill_encoder_decoder(self, rows: Sequence[PrefillRow]) -> PrefilledRows:
        encoder_hidden, encoder_mask = self._encode(rows)
        decoder_inputs = self._decoder_start(rows)
        out = self.model(
            encoder_outputs=(encoder_hidden,),
            attention_mask=encoder_mask,
            decoder_attention_mask=decoder_inputs.mask,
            use_cache=True,
            **{self._cache_keyword: EncoderDecoderCache(self._new_cache(), DynamicCache())},
            **self._ids_or_embeds(decoder_inputs, role="decoder_"),
        )
        batch = PaddedBatch(
            cache=returned_cache(out),
            attention_mask=decoder_inputs.mask,
            next_positions=torch.tensor(decoder_inputs.lengths, dtype=torch.long, device=self.spec.device),
            encoder_hidden=encoder_hidden,
            encoder_mask=encoder_mask,
        )
        return batch, out.logits[:, -1, :].float(), [None] * len(rows)

    def _encode(self, rows: Sequence[PrefillRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder's last hidden states over the rows' inputs (each led by its encoder prefix), and
        the inputs' attention mask."""
        inputs = prefixed_inputs(
            [row.input_ids for row in rows],
            [_input_prefix(row, is_encoder_decoder=True) for row in rows],
            self.spec.pad_token_id,
            self.spec.device,
        )
        encoder = self.model.get_encoder()
        out = encoder(attention_mask=inputs.mask, **self._ids_or_embeds(inputs))
        return out.last_hidden_state, inputs.mask

    def _decoder_start(self, rows: Sequence[PrefillRow]) -> PaddedInputs:
        """The decoder's first inputs: the decoder prefix (if any), then the start token."""
        start = int(self.model.config.decoder_start_token_id)
        return prefixed_inputs(
            [[start]] * len(rows),
            [None if row.prefix is None else row.prefix.decoder for row in rows],
            self.spec.pad_token_id,
            self.spec.device,
        )

    # ---- decode and row removal

    @torch.inference_mode()
    def decode(self, token_ids: Sequence[int]) -> torch.Tensor:
        batch = self._batch
        if batch is None or batch.rows != len(token_ids):
            raise RuntimeError(f"decode got {len(token_ids)} tokens for {self.num_rows} rows")
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.spec.device)[:, None]
        batch.attention_mask = torch.cat([batch.attention_mask, torch.ones_like(ids)], dim=1)
        with self._adapters(self._row_loras):
            out = self._decode_forward(batch, ids)
        batch.next_positions = batch.next_positions + 1
        return out.logits[:, -1, :].float()

    def _decode_forward(self, batch: PaddedBatch, ids: torch.Tensor) -> Any:
        """The model's output for one new token per row (`ids`: [B, 1]) over the cached batch."""
        if self.spec.is_encoder_decoder:
            return self.model(
                encoder_outputs=(batch.encoder_hidden,),
                attention_mask=batch.encoder_mask,
                decoder_input_ids=ids,
                decoder_attention_mask=batch.attention_mask,
                use_cache=True,
                **{self._cache_keyword: batch.cache},
            )
        kwargs: dict[str, Any] = {self._cache_keyword: batch.cache}
        if self._takes_position_ids:
            kwargs["position_ids"] = batch.next_positions[:, None]
        return self.model(input_ids=ids, attention_mask=batch.attention_mask, use_cache=True, **kwargs)

    def keep_rows(self, indices: Sequence[int]) -> None:
        if self._batch is None:
            return
        if not indices:
            self.clear()
            return
        if list(indices) != list(range(self._batch.rows)):
            select(self._batch, torch.tensor(list(indices), dtype=torch.long, device=self.spec.device))
            self._row_loras = [self._row_loras[i] for i in indices]
        self._unload_unused()
