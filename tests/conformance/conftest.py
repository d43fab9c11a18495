"""The conformance servers: one real server per suite model, all with the TGIS integration-suite limits
and the suite's prompt-prefix store, plus the transformers references the expectations come from."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.models import model_dirs_for_suite
from tests.conformance.oracle import Prefix, Reference
from tests.conformance.prefixes import build_store
from tests.integration.harness import ServerThread

# SPEC §14: --max-batch-size 8 --max-waiting-tokens 10 --max-sequence-length 200 --max-new-tokens 169
SUITE_SETTINGS: dict[str, Any] = {
    "max_sequence_length": 200,
    "max_new_tokens": 169,
    "max_batch_size": 8,
    "max_waiting_tokens": 10,
}


@dataclass(frozen=True)
class PrefixStore:
    """The directory every suite server gets as PREFIX_STORE_PATH, and per model what it holds."""

    path: Path
    prefixes: dict[str, dict[str, Prefix]]  # model name → prefix id → embeddings


@pytest.fixture(scope="session")
def suite_models(
    model_dirs: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Model name as the cases spell it → directory (fixtures plus this suite's edited copies)."""
    return model_dirs_for_suite(model_dirs, tmp_path_factory.mktemp("conformance-models"))


@pytest.fixture(scope="session")
def suite_refs(suite_models: dict[str, Path]) -> dict[str, Reference]:
    """Model name → its transformers reference, loaded once."""
    return {name: Reference.load(path) for name, path in suite_models.items()}


@pytest.fixture(scope="session")
def prefix_store(suite_refs: dict[str, Reference], tmp_path_factory: pytest.TempPathFactory) -> PrefixStore:
    path = tmp_path_factory.mktemp("conformance-prefixes")
    return PrefixStore(path, build_store(path, suite_refs))


@pytest.fixture(scope="session")
def suite_servers(
    suite_models: dict[str, Path], prefix_store: PrefixStore
) -> Iterator[dict[str, ServerThread]]:
    servers: dict[str, ServerThread] = {}
    try:
        for name, path in suite_models.items():
            servers[name] = ServerThread(path, prefix_store_path=str(prefix_store.path), **SUITE_SETTINGS)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
