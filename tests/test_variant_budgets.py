"""A deep model's recomputing variants written out from the model cut to a few blocks (issue #42,
aot/plan/variant_budgets.py, aot/plan/written_out.py): each variant the planner prices at a budget
is the step the build makes of the whole model at that budget (aot.passes.recompute.by_budget over
every block, then the passes), op for op, collective for collective, interval for interval: with
no layer checkpointed, with the first layers checkpointed (one region of blocks after them
repeated, or two: the first layers and the rest), and with every layer. Where a budget's first
layers can be written out neither way, the variant is made from every block, and the planner
says so."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from aot.plan import variant_budgets
from helpers.planning import NothingFits
from aot.plan.recompute import Request
from aot.plan.step_synthesis import same_step

MODELS = Path(__file__).resolve().parent / "models"


# (the first budget's fraction, {graph: the first layers it checkpoints}, graphs priced from every block)
CASES = {
    # the derived dp=4 graph written out from 6, 7 and 8 blocks; dp x fsdp=2's needs more first
    # layers than 16 blocks leave room for in one region, too few for two: from every block
    "first-layers": (0.5, {(True, 1, 1): 2, (True, 2, 1): 4}, ["dp x fsdp=2"]),
    # both in two regions, from 8, 9, 9 and 10 blocks, checked at 12
    "two-regions": (0.38, {(True, 1, 1): 6, (True, 2, 1): 8}, []),
    # no layer: from 4, 5 and 6 blocks
    "no-layer": (0.6, {(True, 1, 1): 0, (True, 2, 1): 0}, []),
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c == "no-layer" else c for c in CASES],  # no-layer: the path of the others' least variant
)
def test_variants_written_out_are_the_builds_of_the_whole_model(monkeypatch, case):
    from aot.plan.layout_traces import prefetch
    from aot.plan.machine import Machine
    from aot.plan.model_steps import ModelSteps, Pricing
    from aot.plan.pricing import storage_aliases
    from aot.passes.recompute import budget_breakpoints
    from aot.plan.step_reading import node_seconds
    from runner.hardware.topology import for_nodes, load_profile

    target, layers, whole_priced = CASES[case]
    monkeypatch.setattr(variant_budgets, "FIRST_TARGET", target)
    profile = for_nodes(load_profile("dgx_a100"), None, 4)
    machine = Machine(profile, 4)
    notes: list[str] = []
    steps = ModelSteps(
        MODELS / "llama16.py", 8, pricing=Pricing(profile, world_size=4, max_tp=8, memory_limit=NothingFits(), compute=machine.compute), note=notes.append
    )
    prefetch(steps, ("dp", "fsdp"))
    assert not steps.recompute_failed and set(steps.recomputed) == set(layers)
    fallback = [line for line in notes if "cannot be written out" in line]
    assert [line.split(" priced")[0] for line in fallback] == [f"recomputing activations on {mesh}" for mesh in whole_priced], notes
    cost = lambda n: node_seconds(n, machine.compute)  # noqa: E731
    sharded, slots = steps._capture(2, 2, 1)  # every block: the stamped graph (tests/test_repeated_blocks.py: the whole trace's)
    for key, variants in steps.recomputed.items():
        assert len(variants) == 2  # every layer's, and the first budget's
        for fraction, graph in variants:
            if key[1] == 1:  # dp=4, derived as the planner derives it from every block
                whole, whole_slots, shared = steps._without_fsdp(copy.deepcopy(sharded), 4, 1)
                aliases = storage_aliases(shared)
            else:
                whole, whole_slots, aliases = copy.deepcopy(sharded), slots, None
            bp = budget_breakpoints(whole.graph, cost)
            checkpointed = next(k for k, kept in enumerate(bp.layered) if kept <= fraction * bp.saved_bytes)
            assert checkpointed == (16 if fraction == variants[0][0] else layers[key]), (key, fraction)
            built = steps._finished(whole, whole_slots, aliases, Request(fraction=fraction, source="a test: the build's budget"))
            assert same_step(graph, built) is None, (key, fraction)
            assert graph.memory.to_json() == built.memory.to_json(), (key, fraction)


@pytest.fixture(scope="module")
def tight_plans(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A dgx_a100 whose GPUs hold one byte less (after headroom) than llama16's leanest plan
    without recomputation needs on 4 ranks, and the plans `aot plan` makes recomputing there."""
    import json

    from click.testing import CliRunner

    from aot.cli import cli
    from aot.plan.search import MEMORY_HEADROOM
    from runner.hardware.topology import load_profile

    def plan(*args) -> dict:
        result = CliRunner().invoke(cli, ["plan", LLAMA16, "--world-size", "4", "--axes", "dp,fsdp,tp", "--json", *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    roomy = plan("--topology", "dgx_a100")
    profile = copy.deepcopy(load_profile("dgx_a100"))
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = int((min(p["memory_bytes"]["peak"] for p in roomy["plans"]) - 1) / MEMORY_HEADROOM)
    tight = tmp_path_factory.mktemp("profile") / "tight.json"
    tight.write_text(json.dumps(profile))
    return tight, [p for p in plan("--topology", str(tight))["plans"] if p["recompute"] is not None]


LLAMA16 = str(MODELS / "llama16.py")


@pytest.mark.slow  # two searches of a 16-layer model, then three builds (about 1.5 min); CI runs it
def test_plans_recomputing_at_a_written_out_budget_are_their_builds(tight_plans, tmp_path):
    """As a user runs it: on GPUs that hold one byte less than the leanest plan without
    recomputation needs, `aot plan` prices llama16's meshes recomputing (written out from a few
    blocks), and `aot build` at a plan's strategy, bucket size and stated activation budget
    predicts the plan's step time and peak exactly (the budget makes the same choice over every
    block). Each of three meshes (dp, dp with fsdp, dp with tp) at the bucket size of its plan
    ranked first: the default for one, smaller for the others (for dp=4, 1.45 MiB: there one
    member of a bucket, the loss, outlives the packing, and the bucket holds a copy of it:
    aot/plan/rebucket.py `_retime`)."""
    from click.testing import CliRunner

    from aot.cli import cli
    from aot.defaults import DEFAULT_BUCKET_MB
    from runner.format.artifact import Artifact

    tight, recomputing = tight_plans
    chosen = {}
    for p in recomputing:  # each mesh's plan ranked first
        chosen.setdefault(p["strategy"], p)
    built = [chosen[s] for s in ("dp=4", "dp=2,fsdp=2", "dp=2,tp=2")]
    assert {p["bucket_mb"] == DEFAULT_BUCKET_MB for p in built} == {True, False}, [(p["strategy"], p["bucket_mb"]) for p in built]
    for p in built:
        strategy, art = p["strategy"], tmp_path / p["strategy"]
        args = ["build", LLAMA16, "--topology", str(tight), "--world-size", "4", "--strategy", strategy, "--bucket-mb", str(p["bucket_mb"])]
        args += ["--activation-budget", str(p["recompute"]), "--no-onnx", "--no-eval", "--quiet", "-o", str(art)]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        manifest = Artifact(art).manifest
        assert manifest["time"]["predicted"]["step_s"] == p["step_s"], (strategy, p["recompute"])
        assert manifest["memory"]["predicted"]["peak"] == p["memory_bytes"]["peak"], (strategy, p["recompute"])
