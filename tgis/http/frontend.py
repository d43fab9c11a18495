"""What the HTTP routes add to the service core: the served model's name, `model` read as an adapter id."""

from __future__ import annotations

from tgis.errors import ValidationError
from tgis.service.context import ServiceContext
from tgis.types import SamplingDefaults


class ModelNotFoundError(ValidationError):
    """The request's `model` names neither the served model nor a loadable adapter (HTTP 404)."""


class Frontend:
    """Shared by the HTTP routes; one per server, over the same ServiceContext as gRPC."""

    def __init__(
        self, ctx: ServiceContext, served_model: str, sampling_defaults: SamplingDefaults | None = None
    ) -> None:
        self.ctx = ctx
        self.served_model = served_model
        # generation_config.json's sampling values: the OpenAI routes' defaults (GENERATION_CONFIG=auto)
        self.sampling_defaults = sampling_defaults or SamplingDefaults()

    def encode_words(self, text: str) -> list[int]:
        """A word's tokens with no special tokens around them (vLLM's bad_words)."""
        return list(self.ctx.tokenizer.hf.encode(text, add_special_tokens=False))

    def adapter_id_for_model(self, model: str | None) -> str | None:
        """`model` as vLLM reads it: the served model (or nothing) → no adapter; otherwise an adapter id,
        which the service core loads (a lookup failure is a 404 naming it)."""
        if not model or model == self.served_model:
            return None
        if self.ctx.adapters is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        return model
