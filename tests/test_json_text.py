"""`--json` text: indented, each list of numbers on one line, the same value as json's."""

from __future__ import annotations

import json

import pytest

from aot.json_text import dumps


def test_the_same_value_as_json_with_lists_of_numbers_on_one_line():
    value = {
        "plans": [
            {
                "strategy": "dp=2,tp=2",
                "step_s": 0.125,
                "fits": True,
                "recompute": None,
                "placement": {"identity": False, "physical_rank_of_mesh_rank": list(range(6))},
            },
            {"strategy": "fsdp=4", "algorithms": {}, "skipped": ["pp=2: not priced", "pp=4: not priced"], "shape": (2, 2), "nested": [[1, 2], {"a": "é"}]},
        ],
        1: "int key",
        2.5: "float key",
        False: "bool key",
        None: "null key",
        "empty": {},
    }
    text = dumps(value)
    assert json.loads(text) == json.loads(json.dumps(value))
    assert '"physical_rank_of_mesh_rank": [0, 1, 2, 3, 4, 5]' in [line.strip() for line in text.splitlines()]  # one line
    assert text.splitlines()[:3] == ["{", ' "plans": [', "  {"]  # indented as json.dumps(indent=1)
    assert '"pp=2: not priced",' in [line.strip() for line in text.splitlines()]  # a string keeps its line
    for plain in (3, "x", None, [], {}):
        assert dumps(plain) == json.dumps(plain)


def test_keys_json_cannot_write_are_refused():
    with pytest.raises(TypeError):
        dumps({(1, 2): "a tuple key"})
