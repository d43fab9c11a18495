"""The adapter store: adapter id → loaded, validated entry, in a size-bounded LRU cache (SPEC §8).

Ids name directories under the store's root, or LoRA adapters registered at run time by name and path
(/v1/load_lora_adapter, ALLOW_RUNTIME_LORA_UPDATING); a registered name wins over the root.

Called from several threads. Loads run outside the lock; a second request for an id that is
being loaded waits for that load instead of starting another one."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from engines.base import LoraAdapter, PrefixEmbeddings
from tgis.adapters.ids import adapter_dir
from tgis.adapters.loading import AdapterLoadError, AdapterNotFound, LoadedEntry, PrefixLimits, load_entry
from tgis.errors import Msg
from tgis.metrics import Metrics

MIB = 2**20


class _PendingLoad:
    """The outcome of one in-flight load, shared by every caller asking for the same id."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._entry: LoadedEntry | None = None
        self._error: AdapterLoadError | None = None

    def finish(self, entry: LoadedEntry | None, error: AdapterLoadError | None) -> None:
        self._entry, self._error = entry, error
        self._done.set()

    def result(self) -> PrefixEmbeddings | LoraAdapter:
        self._done.wait()
        if self._error is not None:
            # A fresh exception per waiter: one instance raised in several threads shares a traceback.
            raise type(self._error)(self._error.reason) from self._error
        assert self._entry is not None
        return self._entry.value


class AdapterStore:
    """Resolves adapter ids under `root` and keeps the loaded entries within `cache_size_mb`.

    LoRA entries count in the same budget; when one is evicted its id is queued for
    `drain_evicted_loras`, so that the engine can unload it."""

    def __init__(
        self,
        root: Path | None,
        *,
        is_encoder_decoder: bool,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_prefix_length: int,
        cache_size_mb: int,
        metrics: Metrics | None = None,
    ) -> None:
        self._root = root
        self._limits = PrefixLimits(
            is_encoder_decoder=is_encoder_decoder,
            hidden_size=hidden_size,
            dtype=dtype,
            device=device,
            max_prefix_length=max_prefix_length,
        )
        self._budget_bytes = cache_size_mb * MIB
        self._metrics = metrics
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, LoadedEntry] = OrderedDict()  # least recently used first
        self._loading: dict[str, _PendingLoad] = {}
        self._evicted_loras: list[str] = []
        self._cached_bytes = 0
        self._registered: dict[str, Path] = {}  # runtime LoRA adapters: name → directory

    def get(self, adapter_id: str) -> PrefixEmbeddings | LoraAdapter:
        """The entry for `adapter_id`, loading it on a miss; AdapterLoadError with the §8 reason."""
        start = time.perf_counter()
        try:
            return self._get(adapter_id)
        except AdapterLoadError:
            if self._metrics is not None:
                self._metrics.prompt_load_failure.inc()
            raise
        finally:
            if self._metrics is not None:
                self._metrics.prompt_load_duration.observe(time.perf_counter() - start)

    def available_ids(self) -> list[str]:
        """Ids of the entries under the root (directories holding an adapter), then the registered
        ones, e.g. for /v1/models."""
        markers = ("adapter_config.json", "decoder.pt", "encoder.pt")
        root = self._root
        found = set()
        if root is not None:
            found = {
                str(path.parent.relative_to(root))
                for marker in markers
                for path in root.rglob(marker)
                if path.parent != root
            }
        with self._lock:
            registered = list(self._registered)
        return sorted(found - set(registered)) + registered

    def register_lora(self, name: str, path: Path) -> LoraAdapter:
        """Serve the LoRA adapter in `path` as `name` from now on; loaded (and checked) at once.
        AdapterLoadError when it is not a LoRA adapter this store can load; the name stays unregistered."""
        with self._lock:
            self._registered[name] = path
            self._forget(name)
        try:
            adapter = self.get(name)
            if not isinstance(adapter, LoraAdapter):
                raise AdapterLoadError(f"{path} holds a prompt-tuning prefix, not a LoRA adapter")
        except AdapterLoadError:
            self.unregister(name)
            raise
        return adapter

    def unregister(self, name: str) -> bool:
        """Stop serving a registered adapter (False: no such name); the engine unloads it once no
        running request uses it."""
        with self._lock:
            if self._registered.pop(name, None) is None:
                return False
            self._forget(name)
        return True

    def registered(self, name: str) -> bool:
        with self._lock:
            return name in self._registered

    def drain_evicted_loras(self) -> list[str]:
        """Ids of LoRA entries evicted since the last call (and not loaded again since)."""
        with self._lock:
            drained, self._evicted_loras = self._evicted_loras, []
        return drained

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return self._cached_bytes

    def __contains__(self, adapter_id: object) -> bool:
        with self._lock:
            return adapter_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _get(self, adapter_id: str) -> PrefixEmbeddings | LoraAdapter:
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None:
                self._entries.move_to_end(adapter_id)
                return entry.value
            pending = self._loading.get(adapter_id)
            if pending is None:
                pending = self._loading[adapter_id] = _PendingLoad()
                loader = True
            else:
                loader = False
        if not loader:
            return pending.result()
        try:
            entry = self._load(adapter_id)
            with self._lock:
                del self._loading[adapter_id]
                self._insert(adapter_id, entry)
        except AdapterLoadError as exc:
            self._abandon(adapter_id, pending, exc)
            raise
        except Exception as exc:  # an unexpected failure still fails only this id
            error = AdapterLoadError(str(exc) or type(exc).__name__)
            self._abandon(adapter_id, pending, error)
            raise error from exc
        except BaseException:  # interrupted: waiters must not wait forever
            self._abandon(adapter_id, pending, AdapterLoadError(f"loading {adapter_id} was interrupted"))
            raise
        pending.finish(entry, None)
        return entry.value

    def _forget(self, adapter_id: str) -> None:
        """Drop a cached entry (lock held); a LoRA one is queued for the engine to unload."""
        entry = self._entries.pop(adapter_id, None)
        if entry is not None:
            self._cached_bytes -= entry.size_bytes
            if isinstance(entry.value, LoraAdapter):
                self._evicted_loras.append(adapter_id)

    def _directory(self, adapter_id: str) -> Path:
        with self._lock:
            registered = self._registered.get(adapter_id)
        if registered is not None:
            return registered
        if self._root is None:  # runtime adapters only (no PREFIX_STORE_PATH)
            raise AdapterNotFound(Msg.PREFIX_NOT_FOUND.format(id=adapter_id))
        return adapter_dir(self._root, adapter_id)

    def _load(self, adapter_id: str) -> LoadedEntry:
        entry = load_entry(self._directory(adapter_id), adapter_id, self._limits)
        if entry.size_bytes > self._budget_bytes:
            raise AdapterLoadError(Msg.PREFIX_TOO_LARGE.format(id=adapter_id))
        return entry

    def _abandon(self, adapter_id: str, pending: _PendingLoad, error: AdapterLoadError) -> None:
        with self._lock:
            self._loading.pop(adapter_id, None)
        pending.finish(None, error)

    def _insert(self, adapter_id: str, entry: LoadedEntry) -> None:
        """Add an entry that fits the budget, evicting least recently used ones (lock held)."""
        while self._entries and self._cached_bytes + entry.size_bytes > self._budget_bytes:
            evicted_id, evicted = self._entries.popitem(last=False)
            self._cached_bytes -= evicted.size_bytes
            if isinstance(evicted.value, LoraAdapter):
                self._evicted_loras.append(evicted_id)
        self._entries[adapter_id] = entry
        self._cached_bytes += entry.size_bytes
        if adapter_id in self._evicted_loras:
            self._evicted_loras.remove(adapter_id)
