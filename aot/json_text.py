"""JSON for people and programs at once: `--json` output indented as json.dumps(indent=1) writes
it, but each list of numbers (booleans, nulls) on one line; strings keep a line each.

`aot plan --json` lists every plan a search priced, each with its placement's rank map (a list of
every rank: 16,384 numbers at 2,048 nodes). Indented, json puts each number on a line of its own
and writes everything in Python (its C encoder runs only without indentation): Llama-3-70B's 555
plans at 2,048 nodes were 60 MB and 2.1 s to write. With each such list on one line, written by
the C encoder, they are 34 MB and about a quarter of the time; the document parses to the same
value (tests/test_json_text.py).
"""

from __future__ import annotations

import json
from typing import Any

_OWN_LINE = (dict, list, tuple, str)  # what keeps a line of its own in a list


def dumps(value: Any) -> str:
    """`value` as JSON text (the same value json.loads reads back as from json.dumps(value))."""
    out: list[str] = []
    _write(value, 0, out)
    return "".join(out)


def _write(value: Any, depth: int, out: list[str]) -> None:
    items: list[tuple[str | None, Any]]
    if isinstance(value, dict):
        items = [(_key(k), v) for k, v in value.items()]
        opening, closing = "{", "}"
    elif isinstance(value, (list, tuple)):
        if not value or not isinstance(value[0], _OWN_LINE):
            # numbers, most likely: one line, by the C encoder, where its text shows no string,
            # list or object in it (a scan in C, not a Python loop over 16,384 ranks)
            text = json.dumps(value)
            if '"' not in text and "{" not in text and "[" not in text[1:]:
                out.append(text)
                return
        items = [(None, v) for v in value]
        opening, closing = "[", "]"
    else:
        out.append(json.dumps(value))
        return
    if not items:
        out.append(opening + closing)
        return
    inner = "\n" + " " * (depth + 1)
    out.append(opening)
    for i, (key, v) in enumerate(items):
        out.append(("," if i else "") + inner + (f"{key}: " if key is not None else ""))
        _write(v, depth + 1, out)
    out.append("\n" + " " * depth + closing)


def _key(key: Any) -> str:
    """A key as json writes it: a string; a number, boolean or null as its JSON text, quoted."""
    if not (key is None or isinstance(key, (str, int, float, bool))):
        raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
    return json.dumps(key if isinstance(key, str) else json.dumps(key))
