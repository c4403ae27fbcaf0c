"""`aot plan --topology a,b,c`: the best plan on each profile, fastest first, each row what
`aot plan` says for that profile alone."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from aot.cli import cli
from aot.plan_tables import ms
from helpers.commands import EXAMPLES, aot, show
from runner.commands.formatting import human
from runner.hardware.topology import load_profile

MLP = str(EXAMPLES / "mlp.py")
PROFILES = ("dgx_a100", "dgx_h100", "hgx_h200")
# a batch large enough that the step is bound by the GPUs' FLOP/s and memory bandwidth, not by
# their kernel launches: then the profiles' speeds show in the step time
OPTIONS = ("--world-size", "2", "--batch-size", "262144", "--axes", "dp,fsdp")


def _plan(*args) -> str:
    result = CliRunner().invoke(cli, ["plan", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _speed(name: str) -> tuple[float, float]:
    """(HBM bandwidth, fp32 peak) of a profile's first GPU."""
    gpu = next(iter(load_profile(name)["node"]["gpus"].values()))
    return gpu["memory_bandwidth_gb_per_s"], gpu["peak_tflops"]["fp32"]


def test_whatif_ranks_profiles_as_their_speeds_and_each_row_is_the_single_profile_plan():
    entries = json.loads(_plan(MLP, "--topology", ",".join(PROFILES), *OPTIONS, "--json"))
    assert [e["topology"] for e in entries] == ["hgx_h200", "dgx_h100", "dgx_a100"]
    # faster memory and at least as many FLOP/s: a shorter predicted step, in the table's order
    speeds = [_speed(e["topology"]) for e in entries]
    assert all(a[0] > b[0] and a[1] >= b[1] for a, b in zip(speeds, speeds[1:]))
    steps = [e["best"]["step_s"] for e in entries]
    assert steps == sorted(steps) and len(set(steps)) == 3
    assert all(e["best"]["fits"] and e["world_size"] == 2 for e in entries)

    # the table says what the JSON says, row by row in the same order
    text = _plan(MLP, "--topology", ",".join(PROFILES), *OPTIONS)
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert len(rows) == 3, text
    for row, e in zip(rows, entries):
        best = e["best"]
        assert row[1] == e["name"] and row[3] == best["strategy"], text
        assert ms(best["step_s"]) in row and ms(best["exposed_comm_s"]) in row, text
        assert " ".join(human(best["memory_bytes"]["peak"]).split()) in " ".join(row), text
    assert f"fastest: hgx_h200 with --strategy {entries[0]['best']['strategy']}" in text

    # each row is the first plan of `aot plan` on that profile alone (the graphs the what-if shared
    # across profiles are the ones each plan traces by itself)
    for e in entries:
        single = json.loads(_plan(MLP, "--topology", e["topology"], *OPTIONS, "--json"))
        assert single["topology"] == e["name"] and single["skipped"] == e["skipped"]
        assert single["plans"][0] == e["best"]
        assert len(single["plans"]) == e["plans_priced"]


def test_whatif_with_an_unknown_profile_is_one_line():
    r = aot("plan", MLP, "--topology", "dgx_a100,dgx_h999", "--world-size", "2")
    assert r.returncode == 1 and not r.stdout, show(r)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "'dgx_h999': no such file and no built-in profile of that name" in lines[0], show(r)


@pytest.mark.slow
def test_whatif_prices_recomputation_per_profile_as_each_alone(tmp_path):
    """Graphs shared across profiles only where neither prices them recomputing activations: on GPUs
    of 5 MB gpt.py's plans recompute, on a DGX A100 none does, in either order."""
    small = load_profile("dgx_a100") | {"name": "small"}
    small["node"] = {**small["node"], "gpus": {bus: {**gpu, "memory_bytes": 5_000_000} for bus, gpu in small["node"]["gpus"].items()}}
    path = tmp_path / "small.json"
    path.write_text(json.dumps(small))
    gpt = str(EXAMPLES / "gpt.py")
    alone = {name: json.loads(_plan(gpt, "--topology", name, "--world-size", "2", "--json")) for name in ("dgx_a100", str(path))}
    assert any(p["recompute"] is not None for p in alone[str(path)]["plans"])
    assert all(p["recompute"] is None for p in alone["dgx_a100"]["plans"])
    for order in (("dgx_a100", str(path)), (str(path), "dgx_a100")):
        entries = json.loads(_plan(gpt, "--topology", ",".join(order), "--world-size", "2", "--json"))
        assert {e["topology"]: e["best"] for e in entries} == {name: a["plans"][0] for name, a in alone.items()}
        assert {e["topology"]: e["plans_priced"] for e in entries} == {name: len(a["plans"]) for name, a in alone.items()}
