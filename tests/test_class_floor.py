"""Layout classes that cannot rank first are not written out or priced (aot/plan/class_floor.py).

tests/models/llama_wide.py on 8 ranks of a dgx_h100: its tp=4 and tp=8 steps' compute ops alone
take longer per sample than the two fastest meshes without tp take in all. A default search
leaves those classes out after their cut traces; a search naming its axes prices every class.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aot.plan.class_floor import MARGIN, CannotWin
from aot.plan.cost_model import step_floor
from aot.plan.plans import per_sample_s
from aot.plan.search import plan_model
from runner.hardware.topology import for_nodes, load_profile

REPO = Path(__file__).resolve().parents[1]
WIDE = REPO / "tests" / "models" / "llama_wide.py"
WORLD = 8


@pytest.fixture(scope="module")
def searches() -> dict:
    """llama_wide planned twice in one process: a default search, and one over dp, fsdp and tp
    pricing every class."""
    profile = for_nodes(load_profile("dgx_h100"), None, WORLD)
    return {
        "default": plan_model(WIDE, profile, WORLD, 2, workers=1),
        "every": plan_model(WIDE, profile, WORLD, 2, axes=("dp", "fsdp", "tp"), workers=1),
    }


def _rows(plans) -> list[str]:
    """Each plan without pp as JSON, its placement's axes without pp (a default search has a pp axis of 1)."""
    rows = []
    for p in plans:
        if p.pipeline is None:
            row = p.row()
            row["placement"]["axes_outer_to_inner"].remove("pp") if "pp" in row["placement"]["axes_outer_to_inner"] else None
            rows.append(json.dumps(row, sort_keys=True))
    return rows


def test_a_class_floor_is_under_every_graph_and_plan_of_its_class(searches):
    """The floor read off a class's cut trace is at most the op times of every mesh's graph read
    from that class (cost_model.step_floor, the least the simulation can give), per sample, and
    so at most every plan's time per sample."""
    floors = searches["default"][3].class_floors
    plans, _, planner, steps = searches["every"]
    assert {key[2] for key in floors} == {2, 4, 8}
    checked = set()
    for plan in plans:
        key = steps.class_key(plan.axes, plan.shape)
        if key not in floors:
            continue
        assert floors[key] <= per_sample_s(plan), (plan.strategy, floors[key], per_sample_s(plan))
        if (plan.axes, plan.shape) not in checked:
            checked.add((plan.axes, plan.shape))
            graph = steps(plan.axes, plan.shape)
            times = planner._op_times_for(graph)
            assert floors[key] <= step_floor(times) / plan.data_ranks * (1 + MARGIN), plan.strategy
            # the ops the floor counts (compute on shaped tensors): under fsdp, the floor is nearly all of
            # them (not the few the middle block's copies make outside the block's own forward and
            # backward); without, the optimizer's are shaped too
            shaped = step_floor([t for op, t in zip(graph.ops, times) if op.kind == "compute" and not any(flat for _, _, flat in op.tensors)])
            assert floors[key] <= shaped / plan.data_ranks * (1 + MARGIN), plan.strategy
            if dict(zip(plan.axes, plan.shape))["fsdp"] > 1:
                assert floors[key] >= shaped / plan.data_ranks * 0.99, plan.strategy
    assert len(checked) >= 6


def test_classes_that_cannot_rank_first_are_not_priced_and_the_other_plans_are_the_same(searches):
    """A default search leaves tp=4 and tp=8 out once the classes without tp are priced (not
    written out, each mesh unpriced), says so once per class, and ranks every other plan without
    pp as the search over every class does."""
    plans, skipped, _, steps = searches["default"]
    every, _, _, every_steps = searches["every"]
    left_out = {key for key, error in steps._failed.items() if isinstance(error, CannotWin)}
    assert {key[2] for key in left_out} == {4, 8}
    assert not any(key in steps.traced for key in left_out)
    lines = [line for line in skipped if "compute ops alone" in line]
    assert [line.split(" ")[0] for line in lines] == ["tp=4", "tp=8"], skipped
    out = {key for key, floor in steps.class_floors.items() if f"{floor * 1e3:.4g} ms" in " ".join(lines)}
    assert out == left_out
    expected = [p for p in every if every_steps.class_key(p.axes, p.shape) not in out]
    assert len(expected) < len(every)
    assert _rows(plans) == _rows(expected)
    assert plans[0].strategy == every[0].strategy and plans[0].prediction.step_s == every[0].prediction.step_s


def test_workers_leave_out_what_one_process_leaves_out(searches):
    """With two workers, tp=2 and the class without tp are priced at once, and which classes are
    left out before pricing depends on which finishes first; what the plan says does not."""
    one = searches["default"]
    two = plan_model(WIDE, for_nodes(load_profile("dgx_h100"), None, WORLD), WORLD, 2, workers=2)
    assert _rows(one[0]) == _rows(two[0]) and one[1] == two[1]


def test_a_class_written_out_stops_between_graphs_once_it_cannot_rank_first(searches):
    """A class being written out when another worker's pricing shows it cannot rank first stops
    at the next graph (ClassBound.checkpoint), before any pass over its graphs: tp=4's cut trace,
    written out as the search's bound stands at its end."""
    from aot.plan.written_out import written_out

    _, _, planner, steps = searches["default"]
    key = next(k for k in steps.class_floors if k[1:] == (2, 4))
    derived = steps._derived.get(key, [])
    captured = steps._cut_trace(2, 2, 4)
    passes = []
    steps.passed = lambda *args, **kwargs: passes.append(args)  # counts the passes (none may run)
    planner.bound.judging = (key, derived)
    try:
        with pytest.raises(CannotWin):
            written_out(steps, captured, key, derived)
    finally:
        planner.bound.judging = None
        del steps.passed
    assert passes == []
