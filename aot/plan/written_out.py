"""A deep model's step graphs for the planner, written out from the model at a few depths (issue #42).

ModelSteps (aot/plan/model_steps.py) traces a model of repeated blocks cut to 3 of them. Instead of
stamping that trace out to the model's depth and running the passes and the cost model's reading
over a graph of every block (most of planning's time, and it grows with depth), this module stamps
it out to BASE - 1, BASE and BASE + 1 blocks, runs the passes on those, and writes the deep step
out from the first two (aot.plan.step_synthesis). The graph one block deeper than the base is the
check: the step written out to its depth must equal its own reading, or the mesh is priced from
the whole depth as before. A graph without fsdp is derived from the traced one of the cut model
(aot.plan.pricing.derive_without_fsdp) and stamped out to the same three depths: as the graph
derived from the trace of the model cut to each would be (tests/test_step_synthesis.py), at a
stamp's cost rather than a trace of the step's end at each depth.

A graph from which a plan may not fit gets recomputing variants (`variants_written_out`): at the
budgets aot.plan.variant_budgets chooses, each applied to the graphs of the model cut to three
depths before the passes (`Shallow`) and written out the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from aot.plan.repeated_blocks import KEEP, cut_plan, stamp, truncated
from aot.plan.step_reading import assemble
from aot.plan.step_synthesis import BASE, NotSynthesizable, Tagged, same_step, synthesize, tag
from aot.plan.cost_model import StepGraph

DEPTHS = (BASE - 1, BASE, BASE + 1)  # the depths traced: the two written out from, and the check


class WritingStopped(Exception):
    """Raised between graphs where the graphs being written out are no longer wanted (`_checkpoint`)."""


class Shallow:
    """One graph's steps of the model cut to a few blocks, before the passes, at any depth:
    stamped from its graph of the model cut to KEEP blocks (`graph`, `slots`: the cut trace, or a
    graph without fsdp derived from it, with its storage `aliases`) and kept until taken."""

    def __init__(self, steps: Any, graph: Any, slots: list, aliases: dict | None):
        self.steps, self.graph, self.slots, self.aliases = steps, graph, slots, aliases
        self.kept: dict[int, tuple] = {}  # depth -> (graph module, slots, aliases), never passed
        self.shared: dict = {}  # what the stamps at every depth share (repeated_blocks.stamp)

    def made(self, n: int) -> tuple:
        """(graph module, slots, aliases) at `n` blocks, before the passes (not to be changed)."""
        if n not in self.kept:
            gm, slots = stamp(self.graph, self.slots, self.steps.blocks[0], n, self.shared)
            self.kept[n] = (gm, slots, self.aliases)
        return self.kept[n]

    def passable(self, n: int, again: bool) -> tuple:
        """made(n) for passes to change: a copy where it is asked for `again`, else itself (then
        made again if asked)."""
        if again:
            return _copied(self.made(n))
        self.made(n)
        return self.kept.pop(n)


def written_out(steps: Any, captured: Any, key: tuple, derived: list) -> tuple[dict[tuple, StepGraph], dict[tuple, Shallow]]:
    """({key: the deep step}, {key: its Shallow}) of the traced mesh (`key`, the cut model's trace
    `captured`) and of each (key, mesh) in `derived`, for ModelSteps `steps` (a Shallow keeps
    its graphs before the passes where the planner may price recomputing variants). Raises
    NotSynthesizable (the message says why) where a graph cannot be written out or its check fails."""
    path, depth = steps.blocks
    _checkpoint(steps, captured)
    shallow = {key: Shallow(steps, captured.graph, captured.slots, None)}
    for other, mesh in derived:
        made = _derived(steps, mesh, captured.graph, captured.slots, KEEP)
        if made is None:
            raise NotSynthesizable(f"the graph of {mesh} is not derived from the model cut to {KEEP} blocks")
        shallow[other] = Shallow(steps, *made)
    again = steps.memory_limit is not None  # the graphs before the passes stay for recomputing variants
    graphs: dict[tuple, dict[int, Tagged]] = {}
    for made_key, graph in shallow.items():
        graphs[made_key] = {}
        for n in DEPTHS:
            _checkpoint(steps)
            gm, slots, aliases = graph.passable(n, again)
            graphs[made_key][n] = tag(steps.passed(gm, slots)[0], slots, aliases, path, n)
    return {made_key: checked(tagged, depth) for made_key, tagged in graphs.items()}, shallow


def _checkpoint(steps: Any, captured: Any = None) -> None:
    """Between graphs: raises WritingStopped where the search has found the class being written
    out (its cut trace `captured`, at the start) cannot rank first
    (aot.plan.class_floor.ClassBound.checkpoint: a CannotWin)."""
    bound = getattr(steps, "bound", None)  # a ModelSteps' (tests write out with stand-ins too)
    if bound is not None:
        bound.checkpoint(steps, captured)


def _copied(made: tuple) -> tuple:
    from aot.passes.graph_utils import copy_graph

    gm, slots, aliases = made
    return copy_graph(gm), slots, aliases


def checked(tagged: dict[int, Tagged], depth: int) -> StepGraph:
    """The step at `depth` from the steps at three consecutive depths, once the deepest of them is
    found written out from the other two."""
    before, base, check = (tagged[n] for n in sorted(tagged))
    return _trusted(lambda n: synthesize(base, before, n), check, (check.depth,), (depth,))


def _trusted(write: Callable[..., StepGraph], check: Tagged, at_check: tuple, at_depth: tuple) -> StepGraph:
    """write(*at_depth), once write(*at_check) is the step `check` (of the model cut to that many
    blocks) reads as; else NotSynthesizable."""
    why = same_step(write(*at_check), assemble(check.records))
    if why is not None:
        raise NotSynthesizable(f"written out to {' + '.join(map(str, at_check))} blocks, {why} from its trace")
    return write(*at_depth)


def recomputing_written_out(steps: Any, key: tuple, shallow: Shallow, roomier: Callable | None = None) -> bool:
    """Whether the recomputing variants of ModelSteps `steps`' graph `key` are written out
    (variants_written_out, into steps.recomputed); else a note, and the planner makes them from
    every block."""
    import time

    from aot.plan.variant_budgets import NotPeriodic

    started = time.perf_counter()
    try:
        steps.recomputed[key] = variants_written_out(steps, shallow, key[1] > 1, roomier)
    except (NotSynthesizable, NotPeriodic) as e:
        from aot.plan.plans import mesh_words

        mesh = mesh_words((2 if key[0] else 1, *key[1:]))
        steps.note(f"recomputing activations on {mesh} priced from every block: its variants cannot be written out from a few ({e})")
        return False
    except WritingStopped:
        raise  # the class is left out (aot.plan.class_floor)
    except Exception as e:  # noqa: BLE001  (the plans without recomputation stand; the search says why)
        steps.recompute_failed[key] = f"{type(e).__name__}: {e}"
    finally:
        steps.seconds["recomputing"] += time.perf_counter() - started
    return True


def variants_written_out(steps: Any, shallow: Shallow, sharded: bool, roomier: Callable | None = None) -> list[tuple[float, StepGraph]]:
    """[(activation budget, the deep step recomputing at it)] of the graph `shallow` makes: the
    budgets of aot.plan.variant_budgets, each cut applied to the graphs of the model cut to a few
    depths (checked to keep the bytes it says), the deep variant written out from them and
    checked against one deeper. `roomier(budget, graph)`: a budget above the first worth a
    variant too, or None (aot.plan.variant_budgets.roomier_target). Raises NotSynthesizable or
    aot.plan.variant_budgets.NotPeriodic (the message says why)."""
    import functools

    from aot.passes.recompute import budget_breakpoints
    from aot.plan.step_reading import node_seconds
    from aot.plan.variant_budgets import EVERY_LAYER, FIRST_TARGET, Deep, NotPeriodic

    depth = steps.blocks[1]
    cost = lambda n: node_seconds(n, steps.compute)  # noqa: E731
    points = functools.cache(lambda n: budget_breakpoints(shallow.made(n)[0].graph, cost))
    deep = Deep.of({n: points(n) for n in DEPTHS}, depth)
    out = []
    # the least variant may take the same depths' graphs again
    first = _leading_variant(steps, shallow, points, deep, FIRST_TARGET, keep=set(DEPTHS))
    if first is not None:
        out.append(first)
        target = roomier(*first) if roomier is not None else None
        try:
            # where it checkpoints no first layer: written out from the graphs of the three depths
            # the others read (with k first layers, from graphs k blocks deeper: Llama-3-70B's tp
            # classes, k about 30 of 80, took 40% longer to plan, their best plan unchanged)
            more = _leading_variant(steps, shallow, points, deep, target, keep=set(DEPTHS), most_layers=0) if target is not None else None
        except (NotSynthesizable, NotPeriodic):
            more = None  # the first budget's plans stand
        if more is not None and more[0] > first[0]:
            out.append(more)
    if first is None or steps.memory_limit.more_may_help(first[1], sharded):
        least = deep.budget(EVERY_LAYER)
        if first is None or least < first[0]:
            chosen = {n: (n, EVERY_LAYER) for n in DEPTHS}
            out.append((least, _variant(steps, shallow, points, chosen, lambda tagged: checked(tagged, depth), keep=set())))
    return sorted(out, key=lambda v: v[0])


def _leading_variant(
    steps: Any, shallow: Shallow, points: Callable, deep: Any, target: float, keep: set, most_layers: int | None = None
) -> tuple[float, StepGraph] | None:
    """(its budget, the deep step) of the variant at about `target` of the saved bytes: the
    first layers and whole runs of values by_budget takes there (None: it cannot reach it, or
    it checkpoints more first layers than `most_layers`); the graphs of the depths in `keep`
    stay for another variant."""
    from aot.plan.variant_budgets import first_cut

    depth = steps.blocks[1]
    layers = deep.first_layers(target)
    if layers is None or (most_layers is not None and layers > most_layers):
        return None
    shapes, runs, write = _first_layers(points, layers, depth)
    cut = first_cut(layers, runs, deep.saved, target)
    chosen = {key: (n, replace(cut, layers=k)) for key, (n, k) in shapes.items()}
    return deep.budget(cut, runs), _variant(steps, shallow, points, chosen, write, keep=keep)


def _first_layers(points: Callable, layers: int, depth: int) -> tuple[dict, list, Callable]:
    """How a variant with its first `layers` layers checkpointed is written out: ({shape: (blocks
    of the shallow model, its first layers checkpointed)}, the runs of values at the model's
    depth, how the deep step is written from the shallow ones (and checked)). Where the first
    layers are few, from the model cut to that many and BASE - 1, BASE and BASE + 1 more (one
    region); else from the two regions of aot.plan.step_synthesis.synthesize_two."""
    from aot.plan.step_synthesis import LEADING, synthesize_two
    from aot.plan.variant_budgets import NotPeriodic, deep_runs, deep_runs_two, most_leading

    if layers <= most_leading(depth):
        depths = tuple(n + layers for n in DEPTHS)
        return {n: (n, layers) for n in depths}, deep_runs({n: points(n) for n in depths}, layers, depth), lambda tagged: checked(tagged, depth)
    rest = depth - layers
    if layers < LEADING or rest < BASE:
        raise NotPeriodic(f"the budget checkpoints {layers} of {depth} layers: too few to write out in two regions, or too many")
    corners = [(a, b) for a in (LEADING - 1, LEADING) for b in (BASE - 1, BASE)]
    check = (LEADING + 1, BASE + 1)

    def write(tagged: dict) -> StepGraph:
        return _trusted(lambda first, after: synthesize_two(tagged, first, after), tagged[check], check, (layers, rest))

    shapes = {(a, b): (a + b, a) for a, b in [*corners, check]}
    return shapes, deep_runs_two({(a, b): points(a + b) for a, b in corners}, layers, rest), write


def _variant(steps: Any, shallow: Shallow, points: Callable, chosen: dict, write: Callable, keep: set) -> StepGraph:
    """The deep step recomputing as each shallow model's cut in `chosen` ({shape: (blocks, cut)})
    says, written out by `write`; the graphs of the depths in `keep` stay for another variant."""
    from collections import Counter

    from aot.plan.recompute import Request
    from aot.plan.variant_budgets import shallow_budget

    path = steps.blocks[0]
    uses = Counter(n for n, _ in chosen.values())
    tagged = {}
    for shape, (n, cut) in chosen.items():
        _checkpoint(steps)
        fraction, kept = shallow_budget(cut, points(n))
        uses[n] -= 1
        gm, slots, aliases = shallow.passable(n, again=uses[n] > 0 or n in keep)
        passed, summary = steps.passed(gm, slots, Request(fraction=fraction, source="plan"))
        if summary.get("kept_activation_bytes") != kept:
            raise NotSynthesizable(f"the budget {fraction:g} at {n} blocks kept {summary.get('kept_activation_bytes')} bytes, not {kept}")
        tagged[shape] = tag(passed, slots, aliases, path, n)
    return write(tagged)


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
