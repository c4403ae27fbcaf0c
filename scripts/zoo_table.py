#!/usr/bin/env python3
"""README's model-zoo table from a run of the grid (tests/test_model_zoo.py with AOT_ZOO_RESULTS).

    python scripts/zoo_table.py zoo.jsonl [--commit SHA]

A cell reads `equal` with the worst of its three distances as a share of its bound, twice eager's
noise floor plus the slack (1.00 is the bound), and the AdamW outliers counted if any, `refused` with the line a user sees, or `DIVERGED`. A cell the
run did not reach reads `not run`: the table says what was run, nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.zoo import FAMILIES, NO_COUNTERPART, SLACK, STRATEGIES  # noqa: E402


def ratio(cell: dict) -> float:
    """The worst distance as a share of its bound (the max weight's left out where AdamW's outliers
    were counted instead: tests/helpers/zoo.py `_outliers`)."""
    keys = [k for k in SLACK if k != "max_weight" or cell.get("outliers", 0) == 0]
    return max(cell["distance"][k] / (2 * cell["floor"][k] + SLACK[k]) for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    print(render(args.results.read_text()))


def render(results: str) -> str:
    """The table (markdown) from the grid's JSON lines."""
    cells = {}
    for line in results.splitlines():
        c = json.loads(line)
        cells[(c["family"], c["strategy"])] = c
    commits = sorted({c.get("commit", "?") for c in cells.values()})
    strategies = list(STRATEGIES)
    out = [f"| family | {' | '.join(strategies)} |", f"|---|{'---|' * len(strategies)}"]
    notes = []
    for family in FAMILIES:
        row = []
        for s in strategies:
            c = cells.get((family, s))
            if c is None and (family, s) in NO_COUNTERPART:
                notes.append(f"{family} {s}: {NO_COUNTERPART[family, s]}")
                row.append(f"no counterpart [{len(notes)}]")
            elif c is None:
                row.append("not run")
            elif c["status"] == "equal":
                row.append(f"equal ({ratio(c):.2f})" + (f", {c['outliers']} AdamW outlier" + "s" * (c["outliers"] > 1) if c.get("outliers", 0) > 0 else ""))
            elif c["status"] == "refused":
                notes.append(f"{family} {s}: `{c['line']}`")
                row.append(f"refused [{len(notes)}]")
            else:
                row.append(f"**DIVERGED** ({ratio(c):.2f})")
        out.append(f"| {family} | {' | '.join(row)} |")
    out.append("")
    out += [f"[{i}] {note}  " for i, note in enumerate(notes, 1)]
    out.append(f"\n{len(cells)} cells, run at {', '.join(commits)}.")
    return "\n".join(out)


if __name__ == "__main__":
    main()
