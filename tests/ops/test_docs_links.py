"""The README and the pages under docs/ link only to files and headings that exist, and the README
links every top-level docs page, so that no page is out of a reader's reach."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target may carry a "title" after a space.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation other than - and _
    removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def relative_links(page: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if target and not EXTERNAL.match(target) and not plot_left_out(page, match.group(0)):
                links.append((number, target))
    return links


def plot_left_out(page: Path, link: str) -> bool:
    """One round of a multi-round measurement is kept for its numbers (REPORT.md and results.json)
    without the plot the benchmark tool embeds in every report; the round's summary page has them."""
    return (
        link.startswith("![")
        and link.endswith("(throughput.png)")
        and page.name == "REPORT.md"
        and (page.parent / "results.json").exists()
        and not (page.parent / "throughput.png").exists()
    )


def broken(page: Path, target: str) -> str | None:
    path_part, _, anchor = target.partition("#")
    resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
    if not resolved.exists():
        return "no such file"
    if ROOT not in resolved.parents and resolved != ROOT:
        return "outside the repository"
    if anchor and resolved.suffix == ".md" and unquote(anchor).lower() not in anchors(resolved):
        return f"no heading #{anchor} in {resolved.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    failures = [
        f"{page.relative_to(ROOT)}:{number}: ({target}) {reason}"
        for number, target in relative_links(page)
        if (reason := broken(page, target))
    ]
    assert failures == []


def test_the_readme_links_every_top_level_docs_page() -> None:
    readme = ROOT / "README.md"
    linked = {
        (readme.parent / unquote(target.partition("#")[0])).resolve()
        for _, target in relative_links(readme)
        if target.partition("#")[0]
    }
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert unlinked == []


def test_the_slug_is_githubs() -> None:
    assert slug("Adapters: prompt-tuning prefixes and LoRA") == "adapters-prompt-tuning-prefixes-and-lora"
    assert slug("`PT2_COMPILE`") == "pt2_compile"
    assert slug("The paged step (`PAGED_ATTENTION`)") == "the-paged-step-paged_attention"
    assert slug("Ports and guards") == "ports-and-guards"
    assert slug("hf_custom_tp: several GPUs as one") == "hf_custom_tp-several-gpus-as-one"
