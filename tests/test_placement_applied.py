"""The build applies the mesh placement, and the runner follows it.

tests/fixtures/topology/pcie_4gpu_nvlink_pairs_crossed.json is a 4-GPU PCIe server whose NVLink
bridges join GPU0-GPU2 and GPU1-GPU3: the axis whose collectives carry the most bytes belongs on
those pairs (as `aot plan` places a mesh; mlp's: the data-parallel gradients, more than tp's
activations), so with the mesh written tp first (`tp=2,dp=2`) mesh rank r no longer runs on
rank r. The manifest's `ranks` and `process_groups` are then written in physical ranks
(torchrun's RANK), and a real torchrun job on this CPU machine (gloo; the GPU profile's topology
check told to allow the mismatch) must still train exactly like eager DDP over the data-parallel
ranks: data rank, state shard, checkpoint writer and every collective's member order follow the
coordinates the placement gives each rank, not its number.
"""

from __future__ import annotations

import json

import pytest

from helpers.commands import EXAMPLES, REPO, aot, ok
from helpers.training import assert_same_training, train_both
from runner.format.artifact import manifest_digest

CROSSED = REPO / "tests" / "fixtures" / "topology" / "pcie_4gpu_nvlink_pairs_crossed.json"


def nvlink_pairs(profile: dict) -> set[frozenset[int]]:
    """GPU index pairs joined by NVLink in a profile."""
    index = {bus: g["index"] for bus, g in profile["node"]["gpus"].items()}
    return {frozenset(index[b] for b in link["gpus"]) for link in profile["node"]["links"] if link.get("nvlink")}


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    out = tmp_path_factory.mktemp("placed") / "art"
    ok(aot("build", EXAMPLES / "mlp.py", "--strategy", "tp=2,dp=2", "--topology", CROSSED, "--no-onnx", "-o", out, "--quiet"))
    return out


def test_build_puts_each_group_of_the_busiest_axis_on_an_nvlink_pair(placed):
    manifest = json.loads((placed / "manifest.json").read_text())
    pairs = nvlink_pairs(manifest["topology"]["profile"])
    assert pairs == {frozenset({0, 2}), frozenset({1, 3})}
    dp_groups = manifest["process_groups"]["aot.dp"]["groups"]
    assert {frozenset(g) for g in dp_groups} == pairs
    assert manifest["process_groups"]["aot.tp"]["groups"] == [[0, 1], [2, 3]]
    assert manifest["placement"] == {"axes_outer_to_inner": ["tp", "dp"], "identity": False, "physical_rank_of_mesh_rank": [0, 2, 1, 3]}
    # `ranks` is per physical rank: the coordinates (so the state shard) of the mesh rank placed on it
    coords = {r["rank"]: r["coords"] for r in manifest["ranks"]}
    assert coords == {0: {"tp": 0, "dp": 0}, 1: {"tp": 1, "dp": 0}, 2: {"tp": 0, "dp": 1}, 3: {"tp": 1, "dp": 1}}
    # torch orders a group's members by rank: each member sits at the index of its coordinate
    for spec in manifest["process_groups"].values():
        for group in spec["groups"]:
            assert group == sorted(group) and [coords[r][spec["axis"]] for r in group] == list(range(len(group)))
    text = ok(aot("inspect", placed)).stdout
    assert "placement  mesh rank -> rank 0,2,1,3" in text


def test_groups_out_of_coordinate_order_are_refused(placed, tmp_path):
    """A manifest whose group lists its ranks against their coordinates (hashes rewritten to
    match) is refused in one line: torch would exchange that group's shards out of order."""
    import shutil

    broken = tmp_path / "art"
    shutil.copytree(placed, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    for entry in manifest["ranks"]:  # ranks 0 and 2 trade tp coordinates, the groups stay as they are
        if entry["rank"] in (0, 2):
            entry["coords"]["tp"] = 1 - entry["coords"]["tp"]
    del manifest["placement"]
    manifest["digest"] = manifest_digest(manifest)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    r = aot("inspect", broken)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "does not list its ranks ascending" in r.stderr and "'aot.tp'" in r.stderr


@pytest.mark.parametrize("strategy", ["tp=2,fsdp=2", pytest.param("tp=2,dp=2", marks=pytest.mark.slow)])
def test_placed_mesh_trains_like_ddp(strategy, tmp_path):
    results = train_both(EXAMPLES / "mlp.py", 4, tmp_path, strategy=strategy, build_args=("--topology", CROSSED), run_args=("--allow-topology-mismatch",))
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["placement"]["physical_rank_of_mesh_rank"] == [0, 2, 1, 3]  # really not the identity
    assert_same_training(*results)
