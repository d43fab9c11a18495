"""A report's files: its raw figures as JSON and its Markdown, side by side in one directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report_files(
    out_dir: Path,
    data: Any,
    markdown: str,
    *,
    json_name: str = "results.json",
    markdown_name: str = "REPORT.md",
) -> list[Path]:
    """`data` as indented JSON and `markdown` as it is, into `out_dir` (created if need be)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / json_name
    raw.write_text(json.dumps(data, indent=2) + "\n")
    report = out_dir / markdown_name
    report.write_text(markdown)
    return [raw, report]
