"""Runs an AutoModelForCausalLM / AutoModelForSeq2SeqLM over a left-padded running batch with its KV cache.

Rows may carry a prompt-tuning prefix (spliced in as input embeddings) or a LoRA adapter (peft's
mixed-adapter batches, see engines/lora.py), freely mixed in one batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import transformers
from transformers import AutoConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache

from engines.base import EngineConfig, EngineSpec, PrefillResult, PrefillRow
from engines.common import (
    UnsupportedModelError,
    auto_model_class,
    config_eos_token_ids,
    left_pad,
    prefixed_inputs,
    prefixed_length,
    resolve_device,
    resolve_dtype,
    right_pad,
)
from engines.compiled import CompiledForward, compile_model
from engines.cpu_prepack import prepack_linears
from engines.fused_activations import fuse_activations
from engines.kv_cache import GrowingCache
from engines.lora import LoraAdapters
from engines.paged.engine import PagedHFEngine, PagedUnsupportedError
from engines.paged.engine import build as build_paged

logger = logging.getLogger(__name__)


def _self_attention_layers(cache: Cache) -> list[DynamicLayer]:
    source = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    return _dynamic_layers(source)


def _dynamic_layers(cache: Cache) -> list[DynamicLayer]:
    """The cache's layers; the architectures served here all use plain dynamic key/value layers."""
    layers = list(cache.layers)
    if not all(isinstance(layer, DynamicLayer) for layer in layers):
        raise UnsupportedModelError("only dynamic key/value caches can be batched")
    return cast(list[DynamicLayer], layers)


@dataclass
class _Batch:
    """Tensors describing the running rows; every tensor's first dim is the row."""

    cache: Cache
    attention_mask: torch.Tensor  # [B, T] over cached (decoder) positions
    next_positions: torch.Tensor  # [B] position id of each row's next token
    encoder_hidden: torch.Tensor | None = None  # [B, S, H], encoder-decoder only
    encoder_mask: torch.Tensor | None = None  # [B, S]

    @property
    def rows(self) -> int:
        return int(self.attention_mask.shape[0])


Pad = Callable[[torch.Tensor, int, int], torch.Tensor]


def _stack(old: torch.Tensor, new: torch.Tensor, pad: Pad, length: int, dim: int) -> torch.Tensor:
    """Pad both to `length` along `dim`, then put `new`'s rows after `old`'s."""
    return torch.cat([pad(old, length, dim), pad(new, length, dim)])


def _stack_layers(old: list[DynamicLayer], new: list[DynamicLayer], pad: Pad, length: int) -> None:
    for old_layer, new_layer in zip(old, new, strict=True):
        assert old_layer.keys is not None and old_layer.values is not None
        assert new_layer.keys is not None and new_layer.values is not None
        old_layer.keys = _stack(old_layer.keys, new_layer.keys, pad, length, 2)
        old_layer.values = _stack(old_layer.values, new_layer.values, pad, length, 2)


def _index_layers(layers: list[DynamicLayer], index: tuple[Any, ...]) -> None:
    for layer in layers:
        assert layer.keys is not None and layer.values is not None
        layer.keys = layer.keys[index]
        layer.values = layer.values[index]


def _merge(old: _Batch, new: _Batch) -> _Batch:
    """Append `new` rows after `old` rows, left-padding the shorter decoder cache."""
    length = max(old.attention_mask.shape[1], new.attention_mask.shape[1])
    _stack_layers(_self_attention_layers(old.cache), _self_attention_layers(new.cache), left_pad, length)
    old.attention_mask = _stack(old.attention_mask, new.attention_mask, left_pad, length, 1)
    old.next_positions = torch.cat([old.next_positions, new.next_positions])
    if isinstance(old.cache, EncoderDecoderCache) and isinstance(new.cache, EncoderDecoderCache):
        _merge_encoder(old, new, old.cache, new.cache)
    return old


def _merge_encoder(
    old: _Batch, new: _Batch, old_cache: EncoderDecoderCache, new_cache: EncoderDecoderCache
) -> None:
    """Right-pad encoder states and cross-attention caches to a common source length, then stack."""
    assert old.encoder_hidden is not None and new.encoder_hidden is not None
    assert old.encoder_mask is not None and new.encoder_mask is not None
    length = max(old.encoder_mask.shape[1], new.encoder_mask.shape[1])
    _stack_layers(
        _dynamic_layers(old_cache.cross_attention_cache),
        _dynamic_layers(new_cache.cross_attention_cache),
        right_pad,
        length,
    )
    old.encoder_hidden = _stack(old.encoder_hidden, new.encoder_hidden, right_pad, length, 1)
    old.encoder_mask = _stack(old.encoder_mask, new.encoder_mask, right_pad, length, 1)


def _select(batch: _Batch, indices: torch.Tensor) -> None:
    """Keep only `indices` rows, then drop cache columns that are padding in every remaining row."""
    mask = batch.attention_mask[indices]
    live_columns = mask.any(dim=0).nonzero()
    start = int(live_columns[0]) if live_columns.numel() else mask.shape[1]
    batch.attention_mask = mask[:, start:]
    batch.next_positions = batch.next_positions[indices]
    _index_layers(_self_attention_layers(batch.cache), (indices, slice(None), slice(start, None)))
    if isinstance(batch.cache, EncoderDecoderCache):
        assert batch.encoder_hidden is not None and batch.encoder_mask is not None
        _index_layers(_dynamic_layers(batch.cache.cross_attention_cache), (indices,))
        batch.encoder_hidden = batch.encoder_hidden[indices]
        batch.encoder_mask = batch.encoder_mask[indices]


# A prefill group is split where padding would exceed this fraction of a forward pass's positions, or
# a pass would exceed this many positions (large passes cost more per position on CPU caches).
PREFILL_CHUNK_MAX_PADDING = 0.2
PREFILL_CHUNK_MAX_POSITIONS = 1024


def prefill_chunks(lengths: Sequence[int]) -> list[list[int]]:
    """Row indices per forward pass: all rows in their order when one pass pads little; otherwise rows
    sorted by length, cut where the next row would push padding or size past the limits."""

    def fits(chunk: Sequence[int]) -> bool:
        longest = max(lengths[i] for i in chunk)
        positions = longest * len(chunk)
        padding = (positions - sum(lengths[i] for i in chunk)) / positions
        return padding <= PREFILL_CHUNK_MAX_PADDING and positions <= PREFILL_CHUNK_MAX_POSITIONS

    everything = list(range(len(lengths)))
    if len(lengths) <= 1 or fits(everything):
        return [everything]
    chunks: list[list[int]] = []
    for i in sorted(everything, key=lambda i: lengths[i]):
        if chunks and fits([*chunks[-1], i]):
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


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
        self._batch: _Batch | None = None
        parameters = inspect.signature(model.forward).parameters
        self._takes_position_ids = "position_ids" in parameters
        self._takes_logits_to_keep = "logits_to_keep" in parameters
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

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.model.get_input_embeddings()(ids))

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
            chunk_loras = [row_loras[i] for i in chunk]
            with torch.inference_mode(), self._adapters(chunk_loras):
                if self.spec.is_encoder_decoder:
                    new_batch, chunk_logits, chunk_prompt = self._prefill_encoder_decoder(
                        [rows[i] for i in chunk]
                    )
                else:
                    new_batch, chunk_logits, chunk_prompt = self._prefill_decoder_only(
                        [rows[i] for i in chunk]
                    )
            self._batch = new_batch if self._batch is None else _merge(self._batch, new_batch)
            self._row_loras = self._row_loras + chunk_loras
            logits.append(chunk_logits)
            for i, row_prompt in zip(chunk, chunk_prompt, strict=True):
                prompt_logits[i] = row_prompt
        order = [i for chunk in chunks for i in chunk]
        if order == list(range(len(rows))):
            return PrefillResult(next_token_logits=torch.cat(logits), prompt_logits=prompt_logits)
        position = {row: k for k, row in enumerate(order)}
        given_order = [position[i] for i in range(len(rows))]
        self.keep_rows([*range(first_new_row), *(first_new_row + k for k in given_order)])
        return PrefillResult(next_token_logits=torch.cat(logits)[given_order], prompt_logits=prompt_logits)

    def _prefill_decoder_only(self, rows: Sequence[PrefillRow]):
        prefixes = [_input_prefix(row, is_encoder_decoder=False) for row in rows]
        inputs = prefixed_inputs(
            [row.input_ids for row in rows], prefixes, self.spec.pad_token_id, self.spec.device
        )
        mask = inputs.mask
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        want_prompt = any(row.want_prompt_logits for row in rows)
        kwargs: dict[str, Any] = {}
        if inputs.has_prefix:
            kwargs["inputs_embeds"] = inputs.embeddings(self._embed)
        else:
            kwargs["input_ids"] = inputs.ids
        if self._takes_position_ids:
            kwargs["position_ids"] = positions
        if self._takes_logits_to_keep and not want_prompt:
            kwargs["logits_to_keep"] = 1
        out = self.model(attention_mask=mask, past_key_values=self._new_cache(), use_cache=True, **kwargs)
        logits = out.logits.float()
        width = mask.shape[1]
        prompt_logits: list[torch.Tensor | None] = [
            logits[i, width - length :] if row.want_prompt_logits else None
            for i, (row, length) in enumerate(zip(rows, inputs.lengths, strict=True))
        ]
        batch = _Batch(cache=out.past_key_values, attention_mask=mask, next_positions=positions[:, -1] + 1)
        return batch, logits[:, -1, :], prompt_logits

    def _prefill_encoder_decoder(self, rows: Sequence[PrefillRow]):
        device = self.spec.device
        encoder_inputs = prefixed_inputs(
            [row.input_ids for row in rows],
            [_input_prefix(row, is_encoder_decoder=True) for row in rows],
            self.spec.pad_token_id,
            device,
        )
        mask = encoder_inputs.mask
        encoder = self.model.get_encoder()
        if encoder_inputs.has_prefix:
            encoder_out = encoder(inputs_embeds=encoder_inputs.embeddings(self._embed), attention_mask=mask)
        else:
            encoder_out = encoder(input_ids=encoder_inputs.ids, attention_mask=mask)
        encoder_hidden = encoder_out.last_hidden_state
        # Decoder input: the decoder prefix (if any), then the start token.
        start = int(self.model.config.decoder_start_token_id)
        decoder_inputs = prefixed_inputs(
            [[start]] * len(rows),
            [None if row.prefix is None else row.prefix.decoder for row in rows],
            self.spec.pad_token_id,
            device,
        )
        decoder_mask = decoder_inputs.mask
        if decoder_inputs.has_prefix:
            decoder_kwargs = {"decoder_inputs_embeds": decoder_inputs.embeddings(self._embed)}
        else:
            decoder_kwargs = {"decoder_input_ids": decoder_inputs.ids}
        cache = EncoderDecoderCache(self._new_cache(), DynamicCache())
        out = self.model(
            encoder_outputs=(encoder_hidden,),
            attention_mask=mask,
            decoder_attention_mask=decoder_mask,
            past_key_values=cache,
            use_cache=True,
            **decoder_kwargs,
        )
        batch = _Batch(
            cache=out.past_key_values,
            attention_mask=decoder_mask,
            next_positions=torch.tensor(decoder_inputs.lengths, dtype=torch.long, device=device),
            encoder_hidden=encoder_hidden,
            encoder_mask=mask,
        )
        return batch, out.logits[:, -1, :].float(), [None] * len(rows)

    @torch.inference_mode()
    def decode(self, token_ids: Sequence[int]) -> torch.Tensor:
        batch = self._batch
        if batch is None or batch.rows != len(token_ids):
            raise RuntimeError(f"decode got {len(token_ids)} tokens for {self.num_rows} rows")
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.spec.device)[:, None]
        batch.attention_mask = torch.cat([batch.attention_mask, torch.ones_like(ids)], dim=1)
        with self._adapters(self._row_loras):
            if self.spec.is_encoder_decoder:
                out = self.model(
                    encoder_outputs=(batch.encoder_hidden,),
                    attention_mask=batch.encoder_mask,
                    decoder_input_ids=ids,
                    decoder_attention_mask=batch.attention_mask,
                    past_key_values=batch.cache,
                    use_cache=True,
                )
            else:
                kwargs = {"position_ids": batch.next_positions[:, None]} if self._takes_position_ids else {}
                out = self.model(
                    input_ids=ids,
                    attention_mask=batch.attention_mask,
                    past_key_values=batch.cache,
                    use_cache=True,
                    **kwargs,
                )
        batch.next_positions = batch.next_positions + 1
        return out.logits[:, -1, :].float()

    def keep_rows(self, indices: Sequence[int]) -> None:
        if self._batch is None:
            return
        if not indices:
            self.clear()
            return
        if list(indices) != list(range(self._batch.rows)):
            _select(self._batch, torch.tensor(list(indices), dtype=torch.long, device=self.spec.device))
            self._row_loras = [self._row_loras[i] for i in indices]
        self._unload_unused()


def load(config: EngineConfig) -> HFTransformersEngine | PagedHFEngine:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, cpu_bf16=config.cpu_bf16)
    model_config = AutoConfig.from_pretrained(
        config.model_path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    model_class = auto_model_class(model_config)
    kwargs = {"attn_implementation": config.attn_implementation} if config.attn_implementation else {}
    model = model_class.from_pretrained(
        config.model_path,
        dtype=dtype,
        local_files_only=True,
        trust_remote_code=config.trust_remote_code,
        **kwargs,
    )
    model.to(device).eval()
    fuse_activations(model)
    if not config.compile:  # PT2_COMPILE's inductor lays its own weights out
        prepack_linears(model)
    pad = model_config.pad_token_id
    eos_ids = config_eos_token_ids(model_config)
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    spec = EngineSpec(
        is_encoder_decoder=bool(model_config.is_encoder_decoder),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad),
        device=device,
        dtype=dtype,
        model_config=json.loads(model_config.to_json_string()),
    )
    logger.info(f"Loaded {model_config.model_type} from {config.model_path} on {device} as {dtype}")
    paged = paged_engine_if_possible(model, spec, config)
    if paged is not None:
        return paged
    return HFTransformersEngine(model, compiled_if_asked(model, spec, config))


def load_padded(config: EngineConfig) -> HFTransformersEngine:
    """The padded engine whatever the model supports (for callers that drive rows directly)."""
    engine = load(dataclasses.replace(config, paged=False))
    assert isinstance(engine, HFTransformersEngine)
    return engine


def paged_engine_if_possible(
    model: transformers.PreTrainedModel, spec: EngineSpec, config: EngineConfig
) -> PagedHFEngine | None:
    """The paged engine unless PAGED_ATTENTION=false or the model cannot run it (then None, or a
    startup error when the paged step was required)."""
    if config.paged is False:
        return None
    try:
        engine = build_paged(model, dataclasses.replace(spec, paged=True))
    except PagedUnsupportedError as exc:
        reason = str(exc)
    else:
        logger.info("Serving with the paged step (flat batches over KV blocks, chunked prefill)")
        engine.spec = compiled_if_asked(model, engine.spec, config)
        return engine
    if config.paged:
        raise UnsupportedModelError(
            f"The paged step (PAGED_ATTENTION / FLASH_ATTENTION) cannot serve: {reason}"
        )
    logger.info(f"Serving with padded batches: {reason}")
    return None


def compiled_if_asked(model: torch.nn.Module, spec: EngineSpec, config: EngineConfig) -> EngineSpec:
    """PT2_COMPILE: compile the forward; LoRA is refused then, as peft's per-row hooks would recompile it."""
    if not config.compile:
        return spec
    compile_model(model)
    return dataclasses.replace(spec, supports_lora=False)
