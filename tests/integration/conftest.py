"""Real servers for integration tests: one per fixture architecture, started once per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.harness import ServerThread


@pytest.fixture(scope="session")
def server_for(model_dirs: Callable[[str], Path]) -> Iterator[Callable[[str], ServerThread]]:
    """`server_for(arch)` → a running server on that tiny model, shared by the session's tests."""
    servers: dict[str, ServerThread] = {}

    def get(arch: str) -> ServerThread:
        if arch not in servers:
            servers[arch] = ServerThread(model_dirs(arch))
        return servers[arch]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def chat_checkpoint(model_dirs: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory):
    """The tiny llama as a chat checkpoint: a tools template and a second end id in generation_config.json."""
    from tests.fixtures.chat import build_chat_checkpoint

    return build_chat_checkpoint(tmp_path_factory.mktemp("chat-checkpoint") / "model", model_dirs("llama"))


@pytest.fixture(scope="module")
def chat_server(chat_checkpoint) -> Iterator[ServerThread]:
    """A server on the chat checkpoint, served as `chat`, for one test module."""
    server = ServerThread(chat_checkpoint.path, served_model_name="chat")
    yield server
    server.stop()
