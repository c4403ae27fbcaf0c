"""The model zoo (issue #39): transformers families from config, random init, each under aot's
strategies, every cell equal to eager within eager's own noise floor or refused in one line
(tests/helpers/zoo.py says how a cell is judged).

CI runs one strategy per family (CI_CELLS, marked slow); the whole grid is

    rm -f docs/zoo-results.jsonl
    AOT_ZOO_FULL=1 AOT_ZOO_RESULTS=docs/zoo-results.jsonl python -m pytest tests/test_model_zoo.py -p no:cacheprovider -q
    python scripts/zoo_table.py docs/zoo-results.jsonl     # README's table (between its zoo markers)

whose latest result is README's "Model zoo" table.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers.zoo import FAMILIES, NO_COUNTERPART, STRATEGIES, run_cell

# one strategy per family, chosen for the path the family is likeliest to break
CI_CELLS = {
    "llama": "pp=2",
    "mistral": "fsdp=2",
    "qwen2": "dp=2",
    "qwen3": "tp=2",
    "qwen3_moe": "fsdp=2",
    "gemma2": "tp=2",
    "gemma3": "tp=2",
    "phi3": "tp=2",
    "olmo2": "tp=2",
    "gpt2": "fsdp=2 bf16",
    "bert": "dp=2",
    "t5": "dp=2",
    "mamba": "fsdp=2",
    "resnet": "dp=2",
    "titan_llama": "tp=2",
    "nanogpt": "fsdp=2",
}
# in the default suite too: a whole-width norm inside split attention, which the tp finder must leave
# whole; an optimizer grouping parameters by dim(), which a flat fsdp shard does not show (the other
# cells run in CI)
DEFAULT = {("olmo2", "tp=2"), ("nanogpt", "fsdp=2")}

if os.environ.get("AOT_ZOO_FULL") == "1":
    CELLS = [(f, s) for f in FAMILIES for s in STRATEGIES if (f, s) not in NO_COUNTERPART]
else:
    CELLS = list(CI_CELLS.items())


@pytest.mark.parametrize(
    "family,strategy",
    [pytest.param(f, s, marks=[] if (f, s) in DEFAULT else [pytest.mark.slow], id=f"{f}-{s.replace(' ', '-')}") for f, s in CELLS],
)
def test_zoo_cell_equals_eager_within_its_noise_floor_or_is_refused(family, strategy, tmp_path):
    cell = run_cell(family, strategy, tmp_path)
    assert cell.status in ("equal", "refused"), cell


def test_readme_zoo_table_is_the_grids_latest_result():
    """README's table is scripts/zoo_table.py's rendering of docs/zoo-results.jsonl, the whole grid's
    latest run, cell for cell: README cannot claim a cell that was not run. Every cell in it is equal
    or refused in one line."""
    import importlib.util

    from helpers.commands import REPO

    spec = importlib.util.spec_from_file_location("zoo_table", REPO / "scripts" / "zoo_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    results = (REPO / "docs" / "zoo-results.jsonl").read_text()
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- zoo:begin -->", 1)[1].split("<!-- zoo:end -->", 1)[0]
    assert block.strip() == table.render(results).strip()
    cells = [json.loads(line) for line in results.splitlines()]
    assert len(cells) == len(FAMILIES) * len(STRATEGIES) - len(NO_COUNTERPART)
    assert {c["status"] for c in cells} <= {"equal", "refused"}
