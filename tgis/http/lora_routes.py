"""Runtime LoRA management as vLLM serves it: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Only with ALLOW_RUNTIME_LORA_UPDATING, on the HTTP generation listener behind its guard (API key,
client certificate). A loaded adapter is served by its name as an OpenAI `model`, a TGI `adapter_id`
and a gRPC `adapter_id`, and listed by /v1/models. Messages and statuses are vLLM's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from tgis.adapters.ids import VALID_ADAPTER_ID
from tgis.adapters.loading import AdapterLoadError, AdapterNotFound
from tgis.adapters.store import AdapterStore
from tgis.errors import Msg
from tgis.http.api import HttpApi
from tgis.http.defined_fields import refuse_unimplemented
from tgis.http.errors import HttpError, RequestBody
from tgis.http.frontend import Frontend
from tgis.openmp import run_torch_work

logger = logging.getLogger(__name__)


class LoadLoraBody(RequestBody):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoraBody(RequestBody):
    lora_name: str | None = None

    @classmethod
    def refuse_unimplemented(cls, data: dict[str, Any]) -> None:
        refuse_unimplemented(data, {"lora_int_id": ()})  # vLLM's internal ids; adapters go by name here


class LoraRoutes:
    def __init__(self, frontend: Frontend, api: HttpApi) -> None:
        self.frontend = frontend
        self.api = api  # body parsing; its middleware guards, drains and maps errors around the routes

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    @property
    def _store(self) -> AdapterStore:
        store = self.frontend.ctx.adapters
        assert store is not None  # ALLOW_RUNTIME_LORA_UPDATING always builds one
        return store

    async def load(self, request: web.Request) -> web.Response:
        body: LoadLoraBody = await self.api.parse(request, LoadLoraBody)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise HttpError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if not VALID_ADAPTER_ID.fullmatch(name):
            raise HttpError(400, Msg.PREFIX_ID_CHARS.format(id=name))
        if name == self.frontend.served_model or self._store.registered(name):
            raise HttpError(400, f"The lora adapter '{name}' has already been loaded.")
        spec = self.frontend.ctx.spec
        if not spec.supports_lora:
            raise HttpError(400, Msg.LORA_UNSUPPORTED_BY_ENGINE.format(engine=spec.engine_name))
        store = self._store
        try:
            await run_torch_work(lambda: store.register_lora(name, Path(path)), name="adapter-load")
        except AdapterNotFound as exc:
            raise HttpError(404, f"No adapter found for {path}: {exc.reason}") from exc
        except AdapterLoadError as exc:
            raise HttpError(400, exc.reason) from exc
        logger.info(f"Loaded new LoRA adapter: name '{name}', path '{path}'")
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body: UnloadLoraBody = await self.api.parse(request, UnloadLoraBody)
        name = body.lora_name
        if not name:
            raise HttpError(400, "'lora_name' must be provided.")
        if not self._store.unregister(name):
            raise HttpError(404, f"The lora adapter '{name}' cannot be found.")
        logger.info(f"Removed LoRA adapter: name '{name}'")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
