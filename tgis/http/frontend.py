"""What the HTTP routes add to the service core: the served model's name, `model` read as an adapter id."""

from __future__ import annotations

from tgis.errors import ValidationError
from tgis.service.context import AdapterLookupError, ServiceContext
from tgis.service.validation import Adapter


class ModelNotFoundError(ValidationError):
    """The request's `model` names neither the served model nor a loadable adapter (HTTP 404)."""


class Frontend:
    """Shared by the HTTP routes; one per server, over the same ServiceContext as gRPC."""

    def __init__(self, ctx: ServiceContext, served_model: str) -> None:
        self.ctx = ctx
        self.served_model = served_model

    async def adapter_for_model(self, model: str | None) -> tuple[Adapter | None, str | None]:
        """`model` as vLLM reads it: the served model (or nothing) → base; otherwise an adapter id."""
        if not model or model == self.served_model:
            return None, None
        if self.ctx.adapters is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        try:
            return await self.ctx.adapter(model), model
        except AdapterLookupError as exc:
            raise ModelNotFoundError(exc.message) from exc
