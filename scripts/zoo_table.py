#!/usr/bin/env python3
"""README's model-zoo table from a run of the grid (tests/test_model_zoo.py with AOT_ZOO_RESULTS).

    python scripts/zoo_table.py zoo.jsonl [--commit SHA]

A cell reads `equal` with the worst of its three distances as a multiple of eager's noise floor
plus the slack (1.00 is the bound), `refused` with the line a user sees, or `DIVERGED`. A cell the
run did not reach reads `not run`: the table says what was run, nothing else.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.zoo import FAMILIES, SLACK, STRATEGIES  # noqa: E402


def ratio(cell: dict) -> float:
    return max(cell["distance"][k] / (2 * cell["floor"][k] + SLACK[k]) for k in SLACK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--commit", help="the commit the grid ran at (default: HEAD)")
    args = parser.parse_args()
    cells = {}
    for line in args.results.read_text().splitlines():
        c = json.loads(line)
        cells[(c["family"], c["strategy"])] = c
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    strategies = list(STRATEGIES)
    print(f"| family | {' | '.join(strategies)} |")
    print(f"|---|{'---|' * len(strategies)}")
    notes = []
    for family in FAMILIES:
        row = []
        for s in strategies:
            c = cells.get((family, s))
            if c is None:
                row.append("not run")
            elif c["status"] == "equal":
                row.append(f"equal ({ratio(c):.2f})")
            elif c["status"] == "refused":
                notes.append(f"{family} {s}: `{c['line']}`")
                row.append(f"refused [{len(notes)}]")
            else:
                row.append(f"**DIVERGED** ({ratio(c):.2f})")
        print(f"| {family} | {' | '.join(row)} |")
    print()
    for i, note in enumerate(notes, 1):
        print(f"[{i}] {note}  ")
    print(f"\nGrid run at {commit}: {len(cells)} cells.")


if __name__ == "__main__":
    main()
