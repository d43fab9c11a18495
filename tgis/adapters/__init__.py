"""Adapter store (SPEC §8): prompt-tuning prefixes and LoRA adapters, resolved by id and cached."""

from tgis.adapters.ids import adapter_dir
from tgis.adapters.loading import AdapterLoadError, AdapterNotFound, model_hidden_size
from tgis.adapters.store import AdapterStore

__all__ = ["AdapterLoadError", "AdapterNotFound", "AdapterStore", "adapter_dir", "model_hidden_size"]
