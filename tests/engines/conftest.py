"""Engines under test, built once per session: every DEPLOYMENT_FRAMEWORK on the fixture models it covers."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest

from engines.base import Engine, EngineConfig
from tests.integration.harness import ServerThread

TP_SHARDS = 2
# What each engine must pass the suite on (issue 5); hf_transformers is the baseline.
ENGINE_ARCHS: dict[str, tuple[str, ...]] = {
    "hf_transformers": ("llama", "gpt2", "gpt_neox", "bloom", "t5"),
    "hf_custom_tp": ("llama", "gpt_neox", "bloom", "gpt2", "t5"),
    "hf_optimum_ort": ("llama", "gpt2", "gpt_neox", "bloom", "t5"),
}


def server_settings(engine: str) -> dict[str, object]:
    if engine == "hf_custom_tp":
        return {"deployment_framework": engine, "num_shard": TP_SHARDS, "master_port": 0}
    return {"deployment_framework": engine}


@pytest.fixture(scope="session")
def ort_model_dirs(
    model_dirs: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """A copy of the fixture model with this engine's ONNX graphs in `onnx/`, exported once."""
    from engines import hf_optimum_ort

    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            copy = tmp_path_factory.mktemp(f"ort-{arch}") / arch
            shutil.copytree(model_dirs(arch), copy)
            hf_optimum_ort.main([str(copy)])  # the ahead-of-time export, into copy/onnx
            built[arch] = copy
        return built[arch]

    return get


@pytest.fixture(scope="session")
def engine_model_dir(
    model_dirs: Callable[[str], Path], ort_model_dirs: Callable[[str], Path]
) -> Callable[[str, str], Path]:
    """The model directory an engine serves for an architecture."""

    def get(engine: str, arch: str) -> Path:
        return ort_model_dirs(arch) if engine == "hf_optimum_ort" else model_dirs(arch)

    return get


@pytest.fixture(scope="session")
def suite_server(
    engine_model_dir: Callable[[str, str], Path],
) -> Iterator[Callable[[str, str], ServerThread]]:
    """`suite_server(engine, arch)` → a real server chosen only by DEPLOYMENT_FRAMEWORK, started once."""
    servers: dict[tuple[str, str], ServerThread] = {}

    def get(engine: str, arch: str) -> ServerThread:
        if (engine, arch) not in servers:
            servers[engine, arch] = ServerThread(engine_model_dir(engine, arch), **server_settings(engine))
        return servers[engine, arch]

    yield get
    for server in servers.values():
        server.stop()
        close = getattr(server.server.model.engine, "close", None)
        if close is not None:
            close()


@pytest.fixture(scope="session")
def suite_engine(
    engine_model_dir: Callable[[str, str], Path], suite_server: Callable[[str, str], ServerThread]
) -> Iterator[Callable[[str, str], Engine]]:
    """`suite_engine(engine, arch)` → an engine object to drive directly, row by row (prefill/decode):
    the padded engine. The paged step runs under the suite's server cases, test_paged.py and
    test_hf_custom_tp.py.

    A padded tensor-parallel engine is the one inside that engine's idle test server where the
    server runs padded batches (bloom, t5): starting the shard processes is the slow part, so the
    direct and the through-the-server cases share them. The server's loop calls its engine only
    while it has requests or health probes, and the tests that drive it directly leave it empty
    again (see `driven`).
    """
    from engines.registry import load_engine

    engines: dict[tuple[str, str], Engine] = {}

    def get(engine: str, arch: str) -> Engine:
        if engine == "hf_custom_tp":
            served = suite_server(engine, arch).server.model.engine
            if not served.spec.paged:
                return cast(Engine, served)
        if (engine, arch) not in engines:
            # Driven row by row (prefill/decode): the padded engine. The paged step runs under the
            # suite's server cases and tests/integration/test_paged.py.
            engines[engine, arch] = cast(
                Engine,
                load_engine(
                    engine,
                    EngineConfig(
                        model_path=engine_model_dir(engine, arch),
                        paged=False,
                        num_shards=TP_SHARDS if engine == "hf_custom_tp" else 1,
                        master_port=0,
                    ),
                ),
            )
        return engines[engine, arch]

    yield get
    for loaded in engines.values():
        close = getattr(loaded, "close", None)
        if close is not None:
            close()
