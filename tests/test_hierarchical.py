"""Hierarchical all_reduce: chosen by the cost model per collective, realized in the graph as
collectives over sub-groups, bound by the runner, and training exactly like eager DDP.

On this machine "two nodes" is the cpu profile with --nodes 2: four gloo ranks, two per node, the
node count check told to allow the mismatch (they all run here).
"""

from __future__ import annotations

import json
import shutil

import pytest

from helpers.commands import EXAMPLES, aot, ok
from helpers.training import assert_same_training, train_both
from runner.format.artifact import manifest_digest
from runner.hardware.topology import for_nodes, load_profile

TWO_NODES = ("--topology", "cpu", "--nodes", "2")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = tmp_path_factory.mktemp("hier") / "art"
    ok(aot("build", EXAMPLES / "mlp.py", "--world-size", 4, "--strategy", "dp=4", *TWO_NODES, "--hierarchical", "always", "--no-onnx", "-o", out, "--quiet"))
    return out


def test_all_reduce_becomes_node_then_network_then_node(split):
    m = json.loads((split / "manifest.json").read_text())
    groups = m["process_groups"]
    assert groups["aot.dp.intra"] == {"axis": "dp", "level": "intra", "groups": [[0, 1], [2, 3]]}
    assert groups["aot.dp.inter"] == {"axis": "dp", "level": "inter", "groups": [[0, 2], [1, 3]]}
    kinds = [(c["kind"], c["group"]) for c in m["programs"]["train"]["collectives"]]
    assert ("all_reduce", "aot.dp") not in kinds  # every all_reduce split
    assert (
        kinds.count(("reduce_scatter_tensor", "aot.dp.intra"))
        == kinds.count(("all_reduce", "aot.dp.inter"))
        == kinds.count(("all_gather_into_tensor", "aot.dp.intra"))
        >= 1
    )
    # the network level carries half the bytes (two ranks per node), padded to an even count
    inter = sum(c["bytes"] for c in m["programs"]["train"]["collectives"] if c["group"] == "aot.dp.inter")
    intra = sum(c["bytes"] for c in m["programs"]["train"]["collectives"] if c["kind"] == "reduce_scatter_tensor")
    assert inter * 2 == intra
    assert m["build"]["hierarchical"] == "always"


@pytest.mark.parametrize("model,bucket_mb", [("mlp.py", "25"), ("gpt.py", "0.05")])
def test_hierarchical_trains_like_ddp(model, bucket_mb, tmp_path):
    """Sub-group collectives give eager DDP's losses and weights: a padded bucket (mlp: 6,923
    gradient and loss values over 2 ranks per node) and many buckets (gpt at 50 KiB)."""
    losses, ref_losses, weights, ref_weights = train_both(
        EXAMPLES / model,
        4,
        tmp_path,
        strategy="dp=4",
        build_args=(*TWO_NODES, "--hierarchical", "always", "--bucket-mb", bucket_mb),
        run_args=("--allow-topology-mismatch",),
    )
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert "aot.dp.inter" in manifest["process_groups"]
    assert_same_training(losses, ref_losses, weights, ref_weights)


def test_auto_splits_small_all_reduces_where_the_cost_model_says(tmp_path):
    """cpu profile, 2 nodes: a latency-bound bucket (mlp's 27 KiB) pays 4 message steps split
    against 6 flat; --hierarchical never keeps it flat; one rank per node has no levels."""
    auto, never, single = tmp_path / "auto", tmp_path / "never", tmp_path / "single"
    ok(aot("build", EXAMPLES / "mlp.py", "--world-size", 4, "--strategy", "dp=4", *TWO_NODES, "--no-onnx", "-o", auto, "--quiet"))
    ok(aot("build", EXAMPLES / "mlp.py", "--world-size", 4, "--strategy", "dp=4", *TWO_NODES, "--hierarchical", "never", "--no-onnx", "-o", never, "--quiet"))
    ok(aot("build", EXAMPLES / "mlp.py", "--world-size", 2, "--strategy", "dp=2", *TWO_NODES, "--hierarchical", "always", "--no-onnx", "-o", single, "--quiet"))
    groups = lambda art: {c["group"] for c in json.loads((art / "manifest.json").read_text())["programs"]["train"]["collectives"]}  # noqa: E731
    assert groups(auto) == {"aot.dp.intra", "aot.dp.inter"}
    assert groups(never) == groups(single) == {"aot.dp"}


def test_cost_model_prefers_it_for_latency_and_few_rails():
    """The choice prices the three sub-group collectives against the flat ring: on 2 DGX A100
    nodes (8 rails each) small all_reduces split and 400 MiB ones stay flat, since NCCL's ring
    already drives every rail; a PCIe box with one NIC splits even large ones."""
    from aot.plan import hierarchy
    from aot.plan.machine import Machine
    from aot.plan.placement import identity

    def prefers(name: str, nodes: int, world: int, nbytes: int) -> bool:
        machine = Machine(for_nodes(load_profile(name), nodes, world), world)
        placement = identity(("dp",), (world,))
        levels = hierarchy.levels(machine, placement, "dp")
        assert [len(g) for g in levels.intra] == [world // nodes] * nodes
        assert [len(g) for g in levels.inter] == [nodes] * (world // nodes)
        return hierarchy.hierarchical_wins(machine, placement, levels, nbytes)

    assert prefers("dgx_a100", 2, 16, 2**20) and not prefers("dgx_a100", 2, 16, 400 * 2**20)
    assert prefers("pcie_4gpu_nvlink_pairs", 2, 8, 400 * 2**20)


def test_runner_refuses_a_level_that_does_not_partition_the_world(split, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(split, bad)
    path = bad / "manifest.json"
    m = json.loads(path.read_text())
    m["process_groups"]["aot.dp.inter"]["groups"] = [[0, 2], [1, 2]]
    m["digest"] = manifest_digest(m)
    path.write_text(json.dumps(m))
    r = aot("inspect", bad)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "aot.dp.inter" in r.stderr and "cover each rank once" in r.stderr


def test_aot_plan_prices_the_mode_it_is_given():
    """`aot plan --hierarchical` prices what `aot build --hierarchical` would build: mlp's one
    small bucket on 2 DGX nodes splits under auto and always, stays flat under never."""

    def algorithms(mode: str) -> set:
        r = ok(aot("plan", EXAMPLES / "mlp.py", "--topology", "dgx_a100", "--nodes", 2, "--axes", "dp", "--hierarchical", mode, "--json"))
        return {a for p in json.loads(r.stdout)["plans"] for a in p["algorithms"]}

    assert algorithms("auto") == algorithms("always") == {"all_reduce:hierarchical"}
    assert "all_reduce:hierarchical" not in algorithms("never")


def test_build_strategy_auto_splits_as_the_plan_priced_it(tmp_path):
    """On 2 DGX A100 nodes mlp's best plan (dp=16) reduces its one small bucket in two levels; the
    build's choice prices the flat all_reduce with the algorithm the planner's did
    (BuildPlan.all_reduce_algorithm), so it splits the same collectives, and the plan's predicted
    step is the build's prediction for its program, to the bit."""
    art = tmp_path / "art"
    ok(aot("build", EXAMPLES / "mlp.py", "--topology", "dgx_a100", "--nodes", 2, "--strategy", "auto", "--no-onnx", "-o", art, "--quiet"))
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["world_size"] == 16  # every GPU of both nodes, as `aot plan` plans them by default
    assert manifest["build"]["strategy"] == "dp=16"
    assert manifest["plan"]["predicted"]["algorithms"] == {"all_reduce:hierarchical": 1}
    assert {c["group"] for c in manifest["programs"]["train"]["collectives"]} == {"aot.dp.intra", "aot.dp.inter"}
    assert manifest["plan"]["predicted"]["step_s"] == manifest["time"]["predicted"]["step_s"]
