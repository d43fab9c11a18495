"""The torch modules traced into ONNX graphs: plain tensors in and out, KV caches flattened."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from engines.common import cache_keyword, returned_cache


def _flat(cache: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for layer in cache.layers:
        tensors += [layer.keys, layer.values]
    return tensors


def _pairs(flat: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


class CausalStep(torch.nn.Module):
    """Decoder-only forward over flat past tensors, as the exporter needs plain tensors in and out."""

    def __init__(self, model: Any, takes_position_ids: bool) -> None:
        super().__init__()
        self.model = model
        self.takes_position_ids = takes_position_ids

    def forward(self, input_ids, attention_mask, position_ids, *past):
        cache = DynamicCache(_pairs(past)) if past else DynamicCache()
        kwargs = {"position_ids": position_ids} if self.takes_position_ids else {}
        kwargs[cache_keyword(self.model)] = cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kwargs)
        return (out.logits, *_flat(returned_cache(out)))


class Encoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class Seq2SeqFirstStep(torch.nn.Module):
    """The decoder's first token: computes the cross-attention cache from the encoder states."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, encoder_attention_mask, encoder_hidden_states):
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        out = self.model(
            encoder_outputs=(encoder_hidden_states,),
            attention_mask=encoder_attention_mask,
            decoder_input_ids=input_ids,
            use_cache=True,
            **{cache_keyword(self.model): cache},
        )
        caches = returned_cache(out)
        return (out.logits, *_flat(caches.self_attention_cache), *_flat(caches.cross_attention_cache))


class Seq2SeqStep(torch.nn.Module):
    """One decoder token per row, with the self- and cross-attention caches as inputs."""

    def __init__(self, model: Any, layers: int) -> None:
        super().__init__()
        self.model = model
        self.layers = layers

    def forward(self, input_ids, decoder_attention_mask, encoder_attention_mask, *past):
        own, cross = past[: 2 * self.layers], past[2 * self.layers :]
        # A filled cross cache is reused as is; the encoder states only mark the layers as
        # cross-attention, so a zero tensor of the right shape stands in for them.
        rows, source = encoder_attention_mask.shape
        states = torch.zeros(rows, source, self.model.config.d_model, dtype=cross[0].dtype)
        cache = EncoderDecoderCache(DynamicCache(_pairs(own)), DynamicCache(_pairs(cross)))
        out = self.model(
            encoder_outputs=(states,),
            attention_mask=encoder_attention_mask,
            decoder_input_ids=input_ids,
            decoder_attention_mask=decoder_attention_mask,
            use_cache=True,
            **{cache_keyword(self.model): cache},
        )
        return (out.logits, *_flat(returned_cache(out).self_attention_cache))
