"""docs/errors.md stays true: every row's test exists and checks the words the row quotes."""

from __future__ import annotations

import ast
import re

from helpers.commands import REPO

ROW = re.compile(r"^\| (?P<input>[^|]+) \| `(?P<words>[^`]+)` \| `(?P<test>test_\w+)` \|$")


def test_every_documented_error_is_checked_by_its_test():
    rows = [ROW.match(line) for line in (REPO / "docs" / "errors.md").read_text().splitlines()]
    rows = [r for r in rows if r]
    assert len(rows) >= 25
    sources = {}
    for path in (REPO / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                sources[node.name] = ast.get_source_segment(path.read_text(), node)
    for row in rows:
        test = row["test"]
        assert test in sources, f"docs/errors.md names {test}, which does not exist"
        assert row["words"] in sources[test], f"{test} does not check {row['words']!r}"
