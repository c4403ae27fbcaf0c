"""A deep model's step written out from the same step at a few depths (issue #42,
aot/plan/step_synthesis.py): for every layout class the planner traces, the step written out to 6
and 7 blocks from 4 and 5 (a graph without fsdp derived from the model cut to 6: to 6) is the one the passes and the cost model make of the graph of 6 and 7
blocks, record for record (ops, collectives with where they are issued, waited and read, memory
intervals); and the planner's graphs of a model of 8 blocks, written out, equal those it makes from
the graph of every block."""

from __future__ import annotations

from pathlib import Path

import pytest

from aot.compile_step import step_layout
from aot.plan.layout_traces import prefetch
from aot.plan.model_steps import ModelSteps, Pricing
from aot.plan.repeated_blocks import cut_plan, stamp, truncated
from aot.plan.step_reading import analyze
from aot.plan.step_synthesis import same_step, synthesize, tag
from aot.plan.written_out import _derived
from runner.format.axes import DP, FSDP, TP
from runner.hardware.topology import for_nodes, load_profile

MODELS = Path(__file__).resolve().parent / "models"
BATCH = 4


def planner(model: Path, world_size: int, precision: str | None = None, sequence_parallel: bool = False, notes: list | None = None) -> ModelSteps:
    profile = for_nodes(load_profile("dgx_a100"), 1, max(world_size, 8))
    return ModelSteps(model, BATCH, sequence_parallel=sequence_parallel, pricing=Pricing(profile, world_size, 8, precision), note=(notes or []).append)


@pytest.mark.parametrize(
    "model,mesh,precision,sequence_parallel,derive",
    [
        ("llama6", (2, 2, 1), None, False, True),
        ("llama6", (1, 1, 2), None, False, False),
        ("llama6", (2, 1, 2), None, True, False),
        ("llama6", (1, 2, 1), "bf16", False, False),
        ("checkpointed6", (2, 1, 1), None, False, False),
        ("gpt6", (2, 2, 2), None, False, True),
    ],
    ids=str,
)
def test_a_step_written_out_from_two_depths_is_the_step_of_the_deeper_graph(model, mesh, precision, sequence_parallel, derive):
    dp, fsdp, tp = mesh
    steps = planner(MODELS / f"{model}.py", dp * fsdp * tp, precision, sequence_parallel)
    assert steps.blocks is not None
    path = steps.blocks[0]
    captured = steps._cut_trace(dp, fsdp, tp)
    steps_at, derived_at = {}, {}
    for n in (4, 5, 6, 7):
        gm, slots = stamp(captured.graph, captured.slots, path, n)
        if derive and n <= steps.blocks[1]:  # the graph without fsdp, derived from this one at the same depth (of the model cut to it)
            derived_gm, derived_slots, aliases = _derived(steps, (dp, 1, tp), gm, slots, n)
            steps.passed(derived_gm, derived_slots)
            derived_at[n] = (tag(derived_gm, derived_slots, aliases, path, n), analyze(derived_gm, derived_slots, aliases))
        steps.passed(gm, slots)
        steps_at[n] = (tag(gm, slots, None, path, n), analyze(gm, slots))
    for made in (steps_at, derived_at):
        for depth in [d for d in (6, 7) if d in made]:
            assert same_step(synthesize(made[5][0], made[4][0], depth), made[depth][1]) is None


@pytest.mark.parametrize("model,mesh", [("llama8", (2, 2, 1)), ("llama8", (2, 2, 2)), ("gpt6", (2, 2, 2))], ids=str)
def test_a_graph_without_fsdp_derived_from_the_cut_model_stamps_out_as_one_derived_at_each_depth(model, mesh):
    """The planner derives a mesh's graph without fsdp once, from the trace of the model cut to 3
    blocks, and stamps that out to each depth it reads (aot/plan/written_out.py): the same step, for
    the passes and the cost model, as the graph derived from the model cut to that depth (whose
    step's end is traced there)."""
    dp, fsdp, tp = mesh
    steps = planner(MODELS / f"{model}.py", dp * fsdp * tp)
    assert steps.blocks is not None
    path = steps.blocks[0]
    captured = steps._cut_trace(dp, fsdp, tp)
    cut_gm, cut_slots, cut_aliases = _derived(steps, (2 * dp, 1, tp), captured.graph, captured.slots, 3)
    for n in (4, 6):
        stamped_gm, stamped_slots = stamp(cut_gm, cut_slots, path, n)
        derived_gm, derived_slots, aliases = _derived(steps, (2 * dp, 1, tp), *stamp(captured.graph, captured.slots, path, n), n)
        stamped = analyze(steps.passed(stamped_gm, stamped_slots)[0], stamped_slots, cut_aliases)
        assert same_step(stamped, analyze(steps.passed(derived_gm, derived_slots)[0], derived_slots, aliases)) is None, n


def test_the_planners_graphs_of_a_deep_model_are_written_out_as_its_whole_graphs_price():
    """llama8 on 8 ranks over dp, fsdp and tp: every layout class's graph (those traced, and those
    without fsdp derived from them) written out from 4, 5 and 6 layers equals the graph the planner
    makes from all 8 (tests/test_repeated_blocks.py: itself a whole trace's, node for node)."""
    notes: list[str] = []
    axes = (DP, FSDP, TP)
    written = planner(MODELS / "llama8.py", 8, notes=notes)
    whole = planner(MODELS / "llama8.py", 8)
    whole.write_out = False
    for steps in (written, whole):
        prefetch(steps, axes)
    assert not [line for line in notes if "cannot be written out" in line], notes
    assert set(written.traced) == set(whole.traced) and len(written.traced) >= 4
    for key, graph in written.traced.items():
        assert same_step(graph, whole.traced[key]) is None, key
        assert graph.memory.to_json() == whole.traced[key].memory.to_json()


def test_the_model_cut_to_a_few_blocks_keeps_the_first_ones():
    steps = planner(MODELS / "llama8.py", 2)
    assert steps.blocks is not None
    path = steps.blocks[0]
    cut = truncated(steps.rec, path, 5)
    assert [n for n in cut.state.params if n.startswith(path + ".")][-1].startswith(f"{path}.4.")
    plan = {f"{path}.{i}.attention.wq": "colwise" for i in range(8)}
    assert sorted(cut_plan(plan, path, 5)) == [f"{path}.{i}.attention.wq" for i in range(5)]
    step_layout(cut, steps.target(1, 1, 1), {})  # the cut model lays out as any model
