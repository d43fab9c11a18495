"""The README's index maps every SPEC rule to named cases that exist and agree with the YAML `rules`."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.conformance.cases import load_cases

HERE = Path(__file__).parent
REPO = HERE.parent.parent
# Every numbered part of SPEC §2-§5 and §14 must have at least one row.
SECTIONS: tuple[str, ...] = ("2.1", "2.2", "2.3", "2.4", "2.5", "2.6", "2.7", "3.1", "3.2", "3.3", "4.")
SECTIONS += ("5.1", "5.2", "5.3", "5.4", "5.5", "5.6", "14.")


@dataclass(frozen=True)
class Row:
    rule: str
    names: tuple[str, ...]
    pending: bool


def index_rows() -> list[Row]:
    rows = []
    for line in (HERE / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"\d+(\.\w+)*", cells[0]):
            names = tuple(re.findall(r"`([\w/.:]+)`", cells[2]))
            rows.append(Row(cells[0], names, "pending" in cells[2]))
    return rows


def defined_tests() -> set[str]:
    return {
        m for path in HERE.glob("test_*.py") for m in re.findall(r"^def (test_\w+)", path.read_text(), re.M)
    }


def exists(name: str, yaml_names: set[str], functions: set[str]) -> bool:
    if name in yaml_names or name in functions:
        return True
    path, _, function = name.partition("::")
    file = REPO / path
    return bool(function) and file.is_file() and f"def {function}(" in file.read_text()


def test_every_rule_maps_to_existing_cases() -> None:
    rows = index_rows()
    yaml_names = {case.name for case in load_cases()}
    functions = defined_tests()
    rules = [row.rule for row in rows]
    assert len(rules) == len(set(rules)), "a rule appears twice in the index"
    for section in SECTIONS:
        assert any(rule.startswith(section) for rule in rules), f"no index row for SPEC §{section}"
    for row in rows:
        assert row.names or row.pending, f"rule {row.rule} has no case"
        unknown = [n for n in row.names if not exists(n, yaml_names, functions)]
        assert not unknown, f"rule {row.rule} names cases that do not exist: {unknown}"


def test_index_agrees_with_the_rules_of_each_yaml_case() -> None:
    listed = {row.rule: set(row.names) for row in index_rows()}
    claimed: dict[str, set[str]] = defaultdict(set)
    for case in load_cases():
        for rule in case.rules:
            claimed[rule].add(case.name)
    yaml_names = {case.name for case in load_cases()}
    for rule in sorted(set(listed) | set(claimed)):
        assert rule in listed, f"cases {sorted(claimed[rule])} claim rule {rule}, which the index lacks"
        missing = claimed[rule] - listed[rule]
        extra = (listed[rule] & yaml_names) - claimed[rule]
        assert not missing, f"index row {rule} should also list {sorted(missing)}"
        assert not extra, f"index row {rule} lists {sorted(extra)}, whose `rules` do not include it"


def test_every_yaml_case_is_indexed() -> None:
    indexed = {name for row in index_rows() for name in row.names}
    unindexed = [case.name for case in load_cases() if case.name not in indexed]
    assert not unindexed, f"cases missing from the index: {unindexed}"
