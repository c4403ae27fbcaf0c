"""The planner and recomputation: memory per rank itemized in `aot plan`, and a plan that does not fit
device memory priced again recomputing activations, ranked with the rest and built by
`aot build --strategy auto` with that recomputation.

The device memory of the test profile is computed from the predictions (one byte under what the
leanest plan without recomputation needs), never guessed: every plan without recomputation then
does not fit, and recomputation takes the leanest well under it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from aot.cli import cli
from aot.plan.search import MEMORY_HEADROOM
from runner.format.artifact import Artifact
from runner.hardware.topology import load_profile

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "gpt.py")
WORLD = ["--world-size", "2"]


def _plan(*args, as_json: bool = True):
    result = CliRunner().invoke(cli, ["plan", *args, *(["--json"] if as_json else [])], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if as_json else result.output


@pytest.fixture(scope="module")
def roomy() -> dict:
    """gpt.py on 2 ranks of a dgx_a100 (80 GB: everything fits)."""
    return _plan(GPT, "--topology", "dgx_a100", *WORLD)


@pytest.fixture(scope="module")
def tight(roomy, tmp_path_factory) -> tuple[Path, dict]:
    """A dgx_a100 whose GPUs hold one byte less (after headroom) than the leanest plan without
    recomputation needs, and `aot plan --json` on it."""
    leanest = min(p["memory_bytes"]["peak"] for p in roomy["plans"])
    profile = copy.deepcopy(load_profile("dgx_a100"))
    profile["name"] = "dgx_a100_tight"
    for gpu in profile["node"]["gpus"].values():
        gpu["memory_bytes"] = int((leanest - 1) / MEMORY_HEADROOM)
    path = tmp_path_factory.mktemp("profile") / "tight.json"
    path.write_text(json.dumps(profile))
    return path, _plan(GPT, "--topology", str(path), *WORLD)


def test_plan_itemizes_memory_per_rank(roomy):
    assert roomy["device_memory_bytes"] == 85899345920 and roomy["memory_headroom"] == MEMORY_HEADROOM
    for plan in roomy["plans"]:
        m = plan["memory_bytes"]
        assert plan["recompute"] is None and plan["fits"]  # all fit: nothing recomputed, nothing priced recomputing
        assert m["peak"] == m["params"] + m["buffers"] + m["optimizer"] + m["batch"] + m["peak_transient"]
        assert set(m["at_peak"]) == {"activations", "gradients", "collective_buffers", "updated_state"}
        assert sum(m["at_peak"].values()) == m["peak_transient"]
        assert 0 < m["at_peak"]["activations"] <= m["activations_peak"]
        assert m["params"] > 0 and m["optimizer"] > 0
    by_strategy = {p["strategy"]: p["memory_bytes"] for p in roomy["plans"] if p["bucket_mb"] == 25.0}
    # AdamW: two moments per parameter (and a step counter each); fsdp and tp hold less of each
    assert by_strategy["fsdp=2"]["params"] < by_strategy["dp=2"]["params"]
    assert by_strategy["tp=2"]["optimizer"] < by_strategy["dp=2"]["optimizer"]
    assert by_strategy["dp=2"]["optimizer"] >= 2 * by_strategy["dp=2"]["params"]


def test_plan_table_shows_recompute_and_the_best_plans_memory(roomy):
    text = _plan(GPT, "--topology", "dgx_a100", *WORLD, "--axes", "dp", as_json=False)
    header = text.splitlines()[2]
    assert "recompute" in header and "memory/rank" in header
    line = next(s for s in text.splitlines() if s.startswith("memory of #1: "))
    for part in ("parameters", "optimizer state", "at the peak activations", "gradients", "collective buffers"):
        assert part in line, line


def test_a_plan_that_does_not_fit_is_priced_recomputing_and_ranked_first(tight):
    _, out = tight
    plans = out["plans"]
    assert not any("recomputing" in s for s in out["skipped"]), out["skipped"]
    # (a pipeline, each stage half the model, would fit without recomputing; the planner prices it
    # only where it could rank first)
    assert all(not p["fits"] for p in plans if p["recompute"] is None and "pipeline" not in p)
    best = plans[0]
    assert best["fits"] and best["recompute"] is not None and 0 < best["recompute"] < 1
    assert best["memory_bytes"]["peak"] <= MEMORY_HEADROOM * out["device_memory_bytes"]
    without = next(p for p in plans if p["recompute"] is None and p["strategy"] == best["strategy"] and p["bucket_mb"] == best["bucket_mb"])
    # recomputation frees saved activations and pays for their ops again
    assert best["memory_bytes"]["peak"] < without["memory_bytes"]["peak"]
    assert best["memory_bytes"]["activations_peak"] < without["memory_bytes"]["activations_peak"]
    assert best["step_s"] > without["step_s"] and best["compute_s"] > without["compute_s"]
    # the same collectives, but with fsdp: a recomputed forward gathers its parameters again
    assert best["collectives_per_step"] >= without["collectives_per_step"]
    assert best["collectives_per_step"] == without["collectives_per_step"] or "fsdp" in best["strategy"], best["strategy"]
    # fitting plans first, then by time per sample
    fits = [p["fits"] for p in plans]
    assert fits == sorted(fits, reverse=True)
    fitting = [p["step_s"] / p["data_ranks"] for p in plans if p["fits"]]
    assert fitting == sorted(fitting)


def test_build_strategy_auto_recomputes_as_planned(tight, tmp_path):
    path, out = tight
    best = out["plans"][0]
    art = tmp_path / "art"
    result = CliRunner().invoke(cli, ["build", GPT, "--topology", str(path), *WORLD, "--strategy", "auto", "--no-onnx", "-o", str(art)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"recomputing activations as planned: --activation-budget {best['recompute']:g}" in result.output
    manifest = Artifact(art).manifest
    assert manifest["build"]["strategy"] == best["strategy"] and manifest["build"]["bucket_mb"] == best["bucket_mb"]
    recompute = manifest["memory"]["recompute"]
    assert recompute["policy"] == "budget" and recompute["activation_budget"] == best["recompute"]
    assert recompute["source"] == "plan"
    assert recompute["kept_activation_bytes"] <= best["recompute"] * recompute["saved_activation_bytes"]
    plan = manifest["plan"]
    assert plan["recompute"] == best["recompute"] and plan["candidates"][0]["recompute"] == best["recompute"]
    assert plan["predicted"]["fits"]


def test_the_recomputing_graphs_priced_are_the_builds():
    """Every recomputing variant the planner prices (traced, derived without fsdp, with tp) is the build's graph of that mesh
    with aot.passes.recompute.by_budget applied at that activation budget before the other passes (all of them, bucketing
    aside: the planner buckets analytically)."""
    from aot.capture.step import capture_step
    from aot.passes.cleanup import drop_profiler_calls, plain_collectives
    from aot.passes.recompute import by_budget, recompute_activations
    from aot.passes import PassOptions, run_passes
    from aot.plan.step_reading import analyze, node_seconds
    from aot.plan.machine import Machine
    from aot.plan.layout_traces import prefetch
    from aot.plan.model_steps import ModelSteps, Pricing
    from runner.hardware.topology import for_nodes
    from helpers.planning import NothingFits  # every graph gets its variants, at 0.5 and at the smallest feasible budget
    from test_plan_derived_graphs import _facts

    profile = for_nodes(load_profile("dgx_a100"), None, 2)
    machine = Machine(profile, 2)

    steps = ModelSteps(GPT, 8, pricing=Pricing(profile, world_size=2, max_tp=8, memory_limit=NothingFits(), compute=machine.compute))
    prefetch(steps, ("dp", "fsdp", "tp"))
    assert sorted(steps.recomputed) == [(False, 1, 2), (False, 2, 1), (True, 1, 1)] and not steps.recompute_failed
    assert (True, 1, 1) in steps._derived[(False, 2, 1)][0]  # dp=2's graph derived from fsdp=2's
    cost = lambda n: node_seconds(n, machine.compute)  # noqa: E731
    for key, variants in steps.recomputed.items():
        assert len(variants) == 2 and variants[0][0] < variants[1][0] == 0.5
        captured = capture_step(steps.mf, steps.state, steps.inputs, steps.targets, steps.layout(2 if key[0] else 1, key[1], key[2]), check_ranks=False)
        gm = plain_collectives(drop_profiler_calls(captured.graph))
        for fraction, graph in variants:
            trial = copy.deepcopy(gm)
            choice = by_budget(trial.graph, fraction, cost)
            built = analyze(run_passes(recompute_activations(trial, choice), PassOptions(bucket_bytes=0)), captured.slots)
            assert _facts(graph) == _facts(built), (key, fraction)


@pytest.mark.parametrize("budget", [5, 35, 55, 62, 75, 95])
@pytest.mark.parametrize("slope", [1.0, 0.6, 0.3])
def test_the_budget_search_finds_what_trying_every_point_from_the_top_finds(budget, slope):
    """A memory budget's search over the grid of activation budgets measures only the points the
    peaks measured so far say may fit: with a peak falling linearly in the bytes recomputation
    frees (by a byte per byte freed or less), it finds the point a walk from the top (least
    recomputation first) finds, or none, measuring each point at most once and few of them."""
    from aot.plan.recompute import least_fitting

    peak, freed = 100, [10, 20, 30, 40, 50, 60, 70, 80, 90]
    peaks = [peak - slope * f for f in freed]
    measured: list[int] = []
    found = least_fitting(freed, peak, budget, lambda i: measured.append(i) or peaks[i])  # type: ignore[func-returns-value]
    assert found == next((i for i, p in enumerate(peaks) if p <= budget), None)
    assert len(measured) == len(set(measured))
    assert len(measured) <= 4, measured
    if found is None:
        assert len(peaks) - 1 in measured  # the most recomputation, the smallest peak, was tried


LLAMA16 = str(REPO / "tests" / "models" / "llama16.py")


@pytest.fixture(scope="module")
def llama16_memory() -> dict:
    """llama16's graphs of mesh fsdp=8 and of the traced dp=2 x fsdp=2 (on 8 ranks of a dgx_a100,
    batch 2), each variant recomputing as the planner makes them, with their peaks at the default
    bucket size and what is live at each beside activations: the figures the tests set GPU
    memory from."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from helpers.planning import NothingFits

    from aot.plan.layout_traces import prefetch
    from aot.plan.machine import Machine
    from aot.plan.model_steps import ModelSteps, Pricing
    from aot.plan.rebucket import rebucket
    from aot.plan.search import DEFAULT_BUCKET_MB, MiB
    from runner.hardware.topology import for_nodes

    axes = ("dp", "fsdp")
    profile = for_nodes(load_profile("dgx_a100"), None, 8)
    machine = Machine(profile, 8)
    steps = ModelSteps(Path(LLAMA16), 2, pricing=Pricing(profile, world_size=8, max_tp=8, memory_limit=NothingFits(), compute=machine.compute))
    prefetch(steps, axes)

    def peaks(graph) -> tuple[int, int]:
        m = rebucket(graph, int(DEFAULT_BUCKET_MB * MiB)).memory
        return m.peak, m.peak - m.at_peak.get("activations", 0)

    (every, every_graph), (first, first_graph) = steps.recomputing(axes, (1, 8))
    return {
        "profile": profile,
        "budgets": (every, first),
        "fsdp8": {"every": peaks(every_graph), "first": peaks(first_graph), "none": peaks(steps(axes, (1, 8)))},
        "traced_first": peaks(steps.recomputing(axes, (2, 2))[-1][1]),
    }


def _plan_and_build(memory: dict, limit: float, tmp_path) -> tuple[dict, list[dict]]:
    """`aot plan` of llama16 on 8 ranks whose GPUs hold `limit` bytes after headroom, its best
    plan built (`aot build` at its strategy, bucket size and budget): (the best plan, the plans),
    once the build predicts the best plan's step and peak exactly."""
    tight = copy.deepcopy(memory["profile"])
    for gpu in tight["node"]["gpus"].values():
        gpu["memory_bytes"] = int(limit / MEMORY_HEADROOM) + 1
    path = tmp_path / "tight.json"
    path.write_text(json.dumps(tight))
    common = ["--topology", str(path), "--world-size", "8", "--batch-size", "2"]
    plans = _plan(LLAMA16, *common, "--axes", "dp,fsdp")["plans"]
    best, art = plans[0], tmp_path / "art"
    args = ["build", LLAMA16, *common, "--strategy", best["strategy"], "--bucket-mb", str(best["bucket_mb"])]
    args += ["--activation-budget", str(best["recompute"]), "--no-onnx", "--no-eval", "--quiet", "-o", str(art)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifest = Artifact(art).manifest
    assert manifest["time"]["predicted"]["step_s"] == best["step_s"]
    assert manifest["memory"]["predicted"]["peak"] == best["memory_bytes"]["peak"]
    return best, plans


def test_every_layer_recomputed_is_priced_where_only_a_wider_fsdp_axis_fits_it(llama16_memory, tmp_path):
    """Issue #42, as Llama-3-70B at 2,048 nodes met it: the graph traced with fsdp=2 holds more
    parameter and optimizer state than the GPU, so recomputing more activations cannot make *it*
    fit; the mesh with fsdp over all 8 ranks holds a quarter of that state, and there recomputing
    half the activations does not fit while every layer recomputed does. The planner prices that
    variant, ranks it first, and `aot build` of it predicts the plan's step and peak exactly. The
    GPU's memory is set from the planner's own graphs, between those two variants' peaks."""
    every, first = llama16_memory["budgets"]
    at = llama16_memory["fsdp8"]
    limit = (at["every"][0] + at["first"][0]) // 2
    assert every < first and at["every"][0] < limit < at["first"][0]
    assert llama16_memory["traced_first"][1] > limit  # over the limit without its activations
    best, plans = _plan_and_build(llama16_memory, limit, tmp_path)
    assert best["fits"] and best["strategy"] == "fsdp=8" and best["recompute"] == every, best
    assert not any(p["fits"] for p in plans if p["recompute"] == first or p["recompute"] is None)


def test_a_plan_with_room_recomputes_less_than_half(llama16_memory, tmp_path):
    """Where half the activations recomputed fit with room (the GPU holds four fifths of the way
    from that plan's peak to the peak recomputing nothing, at fsdp=8), the planner also prices a
    budget on the line between them, with a little of the limit left (variant_budgets.roomier_target),
    and ranks its plan first: faster than recomputing half, fitting, and built as planned.
    (Llama-3-8B over 128 nodes: 0.612 instead of 0.5, 5.66 s a step instead of 6.24.)"""
    every, first = llama16_memory["budgets"]
    at = llama16_memory["fsdp8"]
    limit = at["first"][0] + 4 * (at["none"][0] - at["first"][0]) // 5
    best, plans = _plan_and_build(llama16_memory, limit, tmp_path)
    assert best["fits"] and best["recompute"] > first, best
    assert not any(p["fits"] for p in plans if p["recompute"] is None)


def test_variants_that_cannot_be_fastest_are_not_simulated_and_the_choice_is_the_same(llama16_memory):
    """A mesh that does not fit takes the fastest of its variants that fit. The search simulates
    them from the least recomputing and leaves out one whose op times alone add up to more than a
    step already priced (cost_model.step_floor): every plan is the one pricing all of them
    chooses, and the case arises (a fitting variant whose floor is over the chosen step)."""
    from aot.plan.cost_model import simulate, step_floor
    from aot.plan.rebucket import rebucket
    from aot.plan.search import MiB, plan_model

    at = llama16_memory["fsdp8"]
    tight = copy.deepcopy(llama16_memory["profile"])
    for gpu in tight["node"]["gpus"].values():  # room for half the activations recomputed, not for none
        gpu["memory_bytes"] = int((at["first"][0] + 4 * (at["none"][0] - at["first"][0]) // 5) / MEMORY_HEADROOM) + 1
    plans, _, planner, steps = plan_model(Path(LLAMA16), tight, 8, 2, axes=("dp", "fsdp"), workers=1)
    recomputing = [p for p in plans if p.recompute is not None]
    assert recomputing
    left_out = 0
    for plan in recomputing:
        fitting = [(f, rebucket(g, int(plan.bucket_mb * MiB))) for f, g in steps.recomputing(plan.axes, plan.shape)]
        fitting = [(f, g) for f, g in fitting if planner.fits(g.memory.peak)]
        if not fitting:  # none fits: the variant with the lowest peak, always simulated
            continue
        every = [planner.evaluate(plan.axes, plan.shape, plan.bucket_mb, step=g, bucketed=True, placement=plan.placement) for _, g in fitting]
        fastest = min(range(len(every)), key=lambda i: every[i].prediction.step_s)
        assert (plan.recompute, plan.prediction.step_s) == (fitting[fastest][0], every[fastest].prediction.step_s)
        for (_, g), p in zip(fitting, every):
            assert step_floor(planner._op_times_for(g)) <= p.prediction.step_s
            assert simulate(g, planner.machine.compute, lambda c: ("ring", 0.0)).step_s >= step_floor(planner._op_times_for(g))
            left_out += step_floor(planner._op_times_for(g)) > plan.prediction.step_s
    assert left_out
