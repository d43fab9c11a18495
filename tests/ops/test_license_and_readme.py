"""What a fresh clone gives a reader: the licence pyproject.toml names, and a README that stands alone."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install -c requirements.lock torch==2.13.0 -e '.[test]' && "
    ".venv/bin/text-generation-launcher",
    # The TGI client is installed without its dependencies: it pins huggingface-hub<1.0 (see .ci/run).
    "python3 -m venv .venv && .venv/bin/pip install -c requirements.lock torch==2.13.0 -e '.[test]' "
    "-e ./bench && .venv/bin/pip install --no-deps -c requirements.lock text-generation && "
    ".venv/bin/python -m pytest -n auto",
)
# Documents only the development checkout has: the spec (its sections), the issue tracker.
UNAVAILABLE = re.compile(
    r"\bSPEC\b|§|\bshared/|\bissues? #?\d+|(?<!docs/)\bARCHITECTURE\.md\b", re.IGNORECASE
)


def test_the_license_file_is_the_apache_2_text() -> None:
    """The text of the licence each pyproject.toml declares (checked below)."""
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text


@pytest.mark.parametrize("project", ["pyproject.toml", "bench/pyproject.toml"])
def test_each_project_names_its_license_as_an_spdx_expression(project: str) -> None:
    """PEP 639's string, which setuptools 77 reads: it warns that it stops building projects whose
    licence is a `{ text = ... }` table (its deadline: 2027-02-18), so a fresh install would then fail."""
    config = tomllib.loads((ROOT / project).read_text())
    assert config["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in config["build-system"]["requires"]


def test_the_readme_refers_to_no_document_a_reader_does_not_have() -> None:
    readme = (ROOT / "README.md").read_text()
    found = [line for line in readme.splitlines() if UNAVAILABLE.search(line)]
    assert found == []


def test_the_readme_is_a_first_read() -> None:
    """At most about 300 lines: what tgis is, its commands, a client per protocol, the first settings,
    and links to docs/ for everything else."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_readme_starts_with_its_two_commands_unchanged() -> None:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    assert tuple(blocks[:2]) == FIRST_COMMANDS


PACKAGE_INDEX_HOSTS = re.compile(r"pypi\.org|pythonhosted\.org|download\.pytorch\.org|/simple\b")


def test_install_instructions_name_no_package_index_host() -> None:
    """pip's default index needs no URL; another torch index is the operator's TORCH_INDEX_URL."""
    docs = [str(page.relative_to(ROOT)) for page in sorted((ROOT / "docs").rglob("*.md"))]
    for name in ("README.md", "Makefile", "Dockerfile.ubi", *docs):
        text = (ROOT / name).read_text()
        assert not PACKAGE_INDEX_HOSTS.search(text), name
