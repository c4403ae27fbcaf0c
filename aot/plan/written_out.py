"""A deep model's step graphs for the planner, written out from the model at a few depths (issue #42).

ModelSteps (aot/plan/model_steps.py) traces a model of repeated blocks cut to 3 of them. Instead of
stamping that trace out to the model's depth and running the passes and the cost model's reading
over a graph of every block (most of planning's time, and it grows with depth), this module stamps
it out to BASE - 1, BASE and BASE + 1 blocks, runs the passes on those, and writes the deep step
out from the first two (aot.plan.step_synthesis). The graph one block deeper than the base is the
check: the step written out to its depth must equal its own reading, or the mesh is priced from
the whole depth as before. The graphs without fsdp derived from the traced one
(aot.plan.pricing.derive_without_fsdp) are made at the same three depths from the model cut to
them, and written out alike.
"""

from __future__ import annotations

from typing import Any

from aot.plan.repeated_blocks import cut_plan, stamp, truncated
from aot.plan.step_reading import assemble
from aot.plan.step_synthesis import BASE, NotSynthesizable, Tagged, same_step, synthesize, tag
from aot.plan.cost_model import StepGraph

DEPTHS = (BASE - 1, BASE, BASE + 1)  # the depths traced: the two written out from, and the check


def written_out(steps: Any, captured: Any, key: tuple, derived: list) -> dict[tuple, StepGraph]:
    """{key: the deep step} of the traced mesh (`key`, the cut model's trace `captured`) and of
    each (key, mesh) in `derived`, for ModelSteps `steps`. Raises NotSynthesizable
    (the message says why) where a graph cannot be written out or its check fails."""
    path, depth = steps.blocks
    shallow = {n: stamp(captured.graph, captured.slots, path, n) for n in DEPTHS}
    graphs: dict[tuple, dict[int, Tagged]] = {}
    for other, mesh in derived:
        graphs[other] = {}
        for n in DEPTHS:
            made = _derived(steps, mesh, *shallow[n], n)
            if made is None:
                raise NotSynthesizable(f"the graph of {mesh} is not derived at {n} blocks")
            gm, slots, aliases = made
            graphs[other][n] = tag(steps.passed(gm, slots), slots, aliases, path, n)
    graphs[key] = {n: tag(steps.passed(gm, slots), slots, None, path, n) for n, (gm, slots) in shallow.items()}
    out = {}
    for made_key, tagged in graphs.items():
        before, base, check = (tagged[n] for n in DEPTHS)
        why = same_step(synthesize(base, before, check.depth), assemble(check.records))
        if why is not None:
            raise NotSynthesizable(f"written out to {check.depth} blocks, {why} from its trace")
        out[made_key] = synthesize(base, before, depth)
    return out


def _derived(steps: Any, mesh: tuple, gm, slots, n: int):
    """(graph module, slots, aliases) of `mesh` (no fsdp) at `n` blocks, from the graph with fsdp
    `gm` of the model cut to `n` blocks; None where it is not derived."""
    from aot.compile_step import step_layout
    from aot.plan.mesh import Mesh
    from aot.plan.pricing import derive_without_fsdp, storage_aliases
    from runner.format.axes import FSDP

    dp, _, tp, *ep = mesh
    path = steps.blocks[0]
    rec = truncated(steps.recording(*ep), path, n)
    plan = cut_plan(steps.tp_plan(tp), path, n) if tp > 1 else {}
    layout = step_layout(rec, steps.target(dp, 1, tp, *ep), plan)
    got = derive_without_fsdp(rec.mf, rec.state, rec.inputs, rec.targets, layout, gm, Mesh.group_name(FSDP))
    if got is None:
        return None
    derived_gm, derived_slots, shared = got
    return derived_gm, derived_slots, storage_aliases(shared)
