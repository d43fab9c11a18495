"""Fixtures shared by the operations tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.ops.certs import Pki, make_pki


@pytest.fixture
def listening() -> Iterator[int]:
    """A port some other program is listening on."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as other:
        other.bind(("::", 0))
        other.listen()
        yield other.getsockname()[1]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
