"""The dependency rules of the design (docs/architecture.md), checked on every module's imports."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth of the file (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "pb" not in p.relative_to(ROOT).parts[:2])


def violations(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in modules(package):
        for name in sorted(imports_of(path)):
            hit = any(name == f or name.startswith(f + ".") for f in forbidden)
            if hit and not any(name == a or name.startswith(a + ".") for a in allowed):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_engines_never_import_the_service() -> None:
    assert violations("engines", ("tgis",)) == []


def test_batching_is_pure_python_with_no_settings() -> None:
    """batching/ decides which requests and blocks; it never touches torch, settings or engines."""
    third_party_or_project = []
    for path in modules("tgis/batching"):
        for name in imports_of(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or name.startswith("tgis.batching"):
                continue
            third_party_or_project.append(f"{path.relative_to(ROOT)} imports {name}")
    assert third_party_or_project == []


@pytest.mark.parametrize(("door", "other"), [("tgis/http", "tgis.rpc"), ("tgis/rpc", "tgis.http")])
def test_the_front_doors_never_depend_on_each_other(door: str, other: str) -> None:
    assert violations(door, (other, "tgis.app")) == []


@pytest.mark.parametrize("package", ["tgis/service", "tgis/engine_loop", "tgis/batching", "tgis/sampling"])
def test_the_core_never_depends_on_a_front_door(package: str) -> None:
    assert violations(package, ("tgis.rpc", "tgis.http", "tgis.app", "grpc", "aiohttp")) == []


def test_the_engine_loop_never_depends_on_the_service_layer() -> None:
    """The loop takes ValidatedInput (engine_loop/tasks.py) from the service core; it never reaches back."""
    assert violations("tgis/engine_loop", ("tgis.service",)) == []


def test_only_the_sampled_rows_touch_the_sampler() -> None:
    """The runners and speculation sample and verify through SampledRows, never through its sampler."""
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules("tgis/engine_loop")
        if path.name != "sampled_rows.py"
        for name in imports_of(path)
        if name
        in ("tgis.sampling.BatchSampler", "tgis.sampling.sampler", "tgis.sampling.sampler.BatchSampler")
    ]
    assert offenders == []


def test_only_the_grpc_door_knows_protobuf() -> None:
    """The wire contract is converted at the gRPC door (tgis_bench, beside the server, is a gRPC client)."""
    offenders = []
    for path in modules("tgis"):
        if str(path.relative_to(ROOT)).startswith("tgis/rpc"):
            continue
        offenders += [
            f"{path.relative_to(ROOT)} imports {n}" for n in imports_of(path) if n.startswith("tgis.pb")
        ]
    assert offenders == []


@pytest.mark.parametrize("package", ["tgis", "engines"])
def test_the_server_never_imports_the_benchmark_tool(package: str) -> None:
    """tgis_bench (bench/) measures the server from beside it; the server must run without it installed."""
    assert violations(package, ("tgis_bench",)) == []
