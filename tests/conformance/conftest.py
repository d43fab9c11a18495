"""The conformance servers: one real server per suite model, all with the TGIS integration-suite limits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.models import model_dirs_for_suite
from tests.integration.harness import ServerThread

# SPEC §14: --max-batch-size 8 --max-waiting-tokens 10 --max-sequence-length 200 --max-new-tokens 169
SUITE_SETTINGS: dict[str, Any] = {
    "max_sequence_length": 200,
    "max_new_tokens": 169,
    "max_batch_size": 8,
    "max_waiting_tokens": 10,
}


@pytest.fixture(scope="session")
def suite_models(
    model_dirs: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Model name as the cases spell it → directory (fixtures plus this suite's edited copies)."""
    return model_dirs_for_suite(model_dirs, tmp_path_factory.mktemp("conformance-models"))


@pytest.fixture(scope="session")
def suite_servers(suite_models: dict[str, Path]) -> Iterator[dict[str, ServerThread]]:
    servers: dict[str, ServerThread] = {}
    try:
        for name, path in suite_models.items():
            servers[name] = ServerThread(path, **SUITE_SETTINGS)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
