"""requirements.lock is the tested dependency set: it pins every package pyproject.toml asks for, within
pyproject's ranges, and every install path (README, CI, Makefile, image) goes through it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"


def locked_versions() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        assert version, f"not an exact pin: {line!r}"
        assert "+" not in version, f"a local version does not match other builds of it: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def declared_requirements() -> list[Requirement]:
    """The server's dependencies and test extra, and those of the benchmark toolkit (bench/) beside it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bench = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]
    lines = [*project["dependencies"], *project["optional-dependencies"]["test"], *bench["dependencies"]]
    return [Requirement(line) for line in lines if Requirement(line).name != project["name"]]


def test_every_declared_dependency_is_locked_within_its_range() -> None:
    pins = locked_versions()
    for requirement in declared_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not in requirements.lock: run `make lock`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock has {requirement.name}=={pins[name]}, outside pyproject's "
            f"{requirement.specifier}: run `make lock`"
        )


def test_the_locked_torch_is_the_one_every_install_names() -> None:
    torch = locked_versions()["torch"]
    makefile = (ROOT / "Makefile").read_text()
    assert f"TORCH_VERSION ?= {torch}" in makefile
    assert f"ARG TORCH_VERSION={torch}" in (ROOT / "Dockerfile.ubi").read_text()
    assert f"torch=={torch}" in (ROOT / ".ci" / "run").read_text()


def test_every_install_goes_through_the_lock() -> None:
    """No pip install of the project, torch or the TGI client in CI, the Makefile, the image, or the
    README's commands and the production install (docs/operating.md), without `-c` and the lock."""
    installs = re.compile(
        r"(?:pip|\$\(PIP\)) install [^\n]*(torch==|-e |/wheels/|text-generation| \.(?= |$))[^\n]*", re.M
    )
    readme = (ROOT / "README.md").read_text()
    operating = (ROOT / "docs" / "operating.md").read_text()
    production = operating.split("## Production install", 1)[1].split("\n## ", 1)[0]
    texts = {
        "README.md": "\n".join(re.findall(r"```bash\n(.*?)\n```", readme, flags=re.DOTALL)[:2]),
        "docs/operating.md": production,
        **{name: (ROOT / name).read_text() for name in (".ci/run", "Makefile", "Dockerfile.ubi")},
    }
    for name, text in texts.items():
        found = [m.group(0) for m in installs.finditer(text.replace("\\\n", " "))]
        assert len(found) >= 2, name
        for command in found:
            assert re.search(r"-c \S*(requirements\.lock|\$\(LOCK\))", command), (name, command)
