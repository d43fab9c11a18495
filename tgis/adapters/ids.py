"""Adapter ids: the allowed characters and their mapping to a directory inside the store (SPEC §8)."""

from __future__ import annotations

import re
from pathlib import Path

from tgis.adapters.loading import AdapterLoadError
from tgis.errors import Msg

VALID_ADAPTER_ID = re.compile(r"[/\w\-]+")


def adapter_dir(root: Path, adapter_id: str) -> Path:
    """The entry directory of `adapter_id` (nested ids are subdirectories), with symlinks resolved.

    Raises AdapterLoadError when the id has other characters or resolves outside the store
    (an absolute id, or a symlink pointing out of it)."""
    if not VALID_ADAPTER_ID.fullmatch(adapter_id):
        raise AdapterLoadError(Msg.PREFIX_ID_CHARS.format(id=adapter_id))
    store = root.resolve()
    try:
        directory = (store / adapter_id).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise AdapterLoadError(Msg.PREFIX_ID_INVALID.format(id=adapter_id)) from exc
    if store not in directory.parents:
        raise AdapterLoadError(Msg.PREFIX_ID_INVALID.format(id=adapter_id))
    return directory
