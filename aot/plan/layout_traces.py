"""The step graphs a search will ask for, made before it: one trace per layout class, at once.

A search over a mesh's axes prices many meshes, but ModelSteps (aot.plan.model_steps) reads them
all from a handful of traced graphs, one per layout class (the tensor-parallel degree, with or
without fsdp, the graphs without fsdp derived from the fsdp=2 graph of their degree). `needed`
lists those classes for a search; `prefetch` makes them before it, each class in its own worker
process where the machine has the cores (aot.plan.workers: Llama-3-8B's four classes for 1,024
ranks are each several seconds of single-threaded tracing, recomputing and analysis), and merges
what each made (its graphs, their recomputing variants, what failed and why, the
tensor-parallel plans found on the way) into the planner's ModelSteps, as if it had made them
itself: the plans are the same (tests/test_plan_workers.py). Given the planner's pricing, each
worker then prices the meshes read from the graphs it just made, where they are: the cores stay
busy while the slower traces finish, and no graph travels to another worker to be priced (planning
Llama-3-8B for 1,024 ranks, one worker had waited 1.5 s for the other's last trace).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from aot.errors import AotError
from aot.plan.class_floor import CannotWin
from aot.plan.mesh import factorizations
from aot.plan.model_steps import ModelSteps, Unsupported, _key
from aot.plan.written_out import DEPTHS
from aot.plan.plans import mesh_words
from runner.format.axes import DP, EP, FSDP, PP, TP

# what a layout class's trace adds to ModelSteps: a worker sends these entries back
_MADE = ("traced", "recomputed", "recompute_failed", "_failed", "_tp_plans", "class_floors")


def needed(steps: ModelSteps, axes: tuple, meshes: dict[tuple | None, list[tuple]] | None = None) -> list[tuple]:
    """What a search over `axes` will ask to trace: [(key, (dp, fsdp, tp) traced)] in the order
    it first asks (a mesh refused before any trace is left out; a degree the plan cannot take
    is found out when tracing). `meshes`, where given, gets each key's meshes without pp (shapes
    over `axes`), and under None those refused before any trace."""
    from aot.plan.tensor_parallel import check_degree

    first: dict[tuple, tuple] = {}
    for shape in factorizations(steps.world_size or 1, tuple(axes)):
        degrees = dict(zip(axes, shape))
        if degrees.get(PP, 1) > 1:  # the pipeline search's
            continue
        dp, fsdp, tp, ep = degrees.get(DP, 1), degrees.get(FSDP, 1), degrees.get(TP, 1), degrees.get(EP, 1)
        key = None
        try:
            if any(a not in (DP, FSDP, TP, EP) and d > 1 for a, d in degrees.items()) or (tp > 1 and steps.max_tp is not None and tp > steps.max_tp):
                raise Unsupported("refused before any trace")
            if tp > 1:
                check_degree(steps.mf, steps.state.model, tp)
            if ep > 1:
                steps.layout(1, 1, tp, ep)  # a model without experts, or experts ep does not divide
            source = steps._source(dp, fsdp, tp, ep)
            key = _key(*source)
            first.setdefault(key, source)
        except (AotError, Unsupported):
            pass
        if meshes is not None:
            meshes.setdefault(key, []).append(shape)
    return list(first.items())


def prefetch(steps: ModelSteps, axes: tuple, workers: int = 1, price: Callable[[list[tuple]], dict] | None = None) -> dict:
    """Trace, before a search over `axes`, the graphs it will ask for, each graph without fsdp
    derived from the fsdp=2 graph of its tp degree where the search needs that one too, in up to
    `workers` processes at once. What a trace raises is raised again when the search asks for it.

    `price(meshes)` (the planner's Planner.priced, {mesh: what the search makes of it}), where
    given, runs right after each trace on the meshes read from its graphs, in the worker that
    holds them: no worker waits for the slowest trace before the pricing starts, and no graph is
    sent to another worker. Returns what it made, for every such mesh ({} without `price`)."""
    from aot.plan.workers import in_workers, will_fork

    if steps.world_size is None:
        return {}
    meshes: dict[tuple | None, list[tuple]] = {}
    todo = [(key, source) for key, source in needed(steps, axes, meshes) if key not in steps.traced and key not in steps._failed]
    # mixed precision: the fsdp graph gathers parameters in the compute dtype, which the graph
    # without fsdp does not, so its forward is not the one to derive from: each is traced
    # keyed by (tp, ep): a graph without fsdp is derived from the fsdp=2 graph of its tp and ep degrees
    sharded = {} if steps.precision.mixed else {key[2:]: key for key, _ in todo if key[1] == 2}
    for key, source in todo:
        if key[1] == 1 and key[2:] in sharded:
            steps._derived.setdefault(sharded[key[2:]], []).append((key, source))
    traced = [(key, source) for key, source in todo if not (key[1] == 1 and key[2:] in sharded)]
    # the longest first, so that the workers finish together: the graphs others are derived from,
    # then the lower tp degrees (larger per-rank graphs, the likelier to need recomputing variants)
    traced.sort(key=lambda job: (not steps._derived.get(job[0]), job[0][2]))
    ordered = _ordered(steps, traced)
    jobs = [(i, kind, key, source, len(ordered), os.getpid()) for i, (kind, key, source) in enumerate(ordered)]
    # each job's meshes: its own graph's and those of the graphs derived from it
    shapes = {key: [m for k in (key, *(other for other, _ in steps._derived.get(key, ()))) for m in meshes.get(k, ())] for key, _ in traced}
    started = time.perf_counter()
    spent = {"tracing": 0.0, "recomputing": 0.0, "pricing": 0.0}
    priced: dict = {}

    def work(job: tuple) -> dict[str, Any]:
        _, kind, key, source, _, planner = job
        made = _made(steps, planner, lambda: _cut(steps, key, source) if kind == CUT else _trace(steps, key, source))
        if price is not None and kind != CUT:
            before = time.perf_counter()
            made["priced"] = price(shapes[key])
            made["seconds"]["pricing"] = time.perf_counter() - before
        return made

    announce = lambda job: _announce(steps, job, len(shapes[job[2]]) if price is not None else 0)  # noqa: E731
    for made in in_workers(jobs, work, workers, started=announce):
        for line in made.pop("notes"):  # what a worker said while tracing, said here once it is done
            steps.note(line)
        priced.update(made.pop("priced", {}))
        seconds = made.pop("seconds")
        for part in spent:
            spent[part] += seconds.get(part, 0.0)
        for name, entries in made.items():
            getattr(steps, name).update(entries)
    wall = time.perf_counter() - started
    steps._held.clear()  # the cut traces of classes left out (in this process, where there are no workers)
    if will_fork(jobs, workers):
        # the seconds the traces took, split between tracing, recomputing and pricing as the
        # workers' were (their clocks ran in their own copies of `steps`; summed, they exceed the
        # wall time the search waited). In this process `steps` has counted them already.
        busy = spent["tracing"] + spent["pricing"]
        traced_share = spent["tracing"] / busy if busy else 0.0
        share = spent["recomputing"] / spent["tracing"] if spent["tracing"] else 0.0
        steps.seconds["tracing"] += wall * traced_share
        steps.seconds["recomputing"] += wall * traced_share * share
    if price is not None:  # the meshes refused before any trace (each says why at once): priced here, unannounced
        priced.update(price(meshes.get(None, [])))
    return priced


# a layout class's job (`prefetch`): traced and priced whole; or traced cut to judge it first
# (class_floor: a class that cannot rank first is not written out), then written out and priced
WHOLE, CUT, WRITE = "whole", "cut", "write"


def _ordered(steps: ModelSteps, traced: list[tuple]) -> list[tuple]:
    """[(kind, key, source)]: each class of `traced` (in that order) as one WHOLE job, or where
    the search judges classes before writing them out (`steps.bound`: a default search; a model
    written out from a few of its blocks), the class it always prices first, then each other
    class's CUT trace, then its WRITE job. Two workers then price the class without tp while the
    other traces the rest cut; by the time that one writes them out the first is priced, and the
    classes that cannot rank first are left out (a WRITE job in the worker that did not trace its
    class cut judges it by the floor that worker shared, else traces it again)."""
    bound = steps.bound
    if bound is None or not steps.write_out or steps.blocks is None or steps.blocks[1] <= max(DEPTHS):
        return [(WHOLE, key, source) for key, source in traced]
    ahead = [(key, source) for key, source in traced if bound.judged(key)]
    bound.share([key for key, _ in ahead])
    first = [(WHOLE, key, source) for key, source in traced if not bound.judged(key)]
    return first + [(CUT, key, source) for key, source in ahead] + [(WRITE, key, source) for key, source in ahead]


def _announce(steps: ModelSteps, job: tuple, priced: int) -> None:
    """The note a job makes as it starts: what it traces, and how many meshes it prices after."""
    i, kind, key, source, count, _ = job
    derived = len(steps._derived.get(key, ()))
    if kind == CUT:
        steps.note(f"tracing the step on {mesh_words(source)} cut to a few blocks ({i + 1} of {count}), to judge whether it can rank first")
        return
    steps.note(
        f"{'writing out' if kind == WRITE else 'tracing'} the step on {mesh_words(source)} ({i + 1} of {count})"
        + (f", {derived} more graph(s) derived from it" if derived else "")
        + (f", then pricing the {priced} mesh{'es' if priced != 1 else ''} read from {'them' if derived else 'it'}" if priced else "")
    )


def _trace(steps: ModelSteps, key: tuple, source: tuple) -> None:
    """Trace layout class `key` (on mesh `source`, and the graphs derived from it) into `steps`;
    where the search judges classes, judge it before (on the floor its CUT job shared), as it is
    written out and after (a class priced meanwhile may show it cannot rank first: then its
    meshes are not priced): class_floor.ClassBound.checkpoint."""
    derived = steps._derived.get(key, [])
    bound = steps.bound if steps.bound is not None and steps.bound.judged(key) else None
    if bound is not None:
        bound.judging = (key, derived)
    try:
        if bound is not None:
            bound.checkpoint(steps)
        steps._traced(*source)
        if bound is not None:
            bound.checkpoint(steps)
    except Exception as e:  # noqa: BLE001  (raised again when the search asks for this graph)
        steps._failed[key] = e
        if isinstance(e, CannotWin):
            for k in [key, *(other for other, _ in derived)]:
                steps.traced.pop(k, None)  # not sent back: never priced
    finally:
        if bound is not None:
            bound.judging = None


def _cut(steps: ModelSteps, key: tuple, source: tuple) -> None:
    """Trace class `key` cut to a few blocks, held in this process for its WRITE job, and its
    floor shared (class_floor.ClassBound.floor). A trace that fails is left to the WRITE job,
    which fails the same way."""
    started = time.perf_counter()
    try:
        steps._held[key] = steps._cut_trace(*source)
    except Exception:  # noqa: BLE001
        return
    finally:
        steps.seconds["tracing"] += time.perf_counter() - started
    steps.bound.floor(steps, key, steps._held[key], steps._derived.get(key, []))


def _made(steps: ModelSteps, planner: int, run: Callable[[], None]) -> dict[str, Any]:
    """run(), and what it added to `steps` (the entries of _MADE, what it noted, and the seconds
    it took): in a worker (a process other than `planner`'s), those go back to the planner; in
    the planner's own process they are already there, and its notes said."""
    before = {name: set(getattr(steps, name)) for name in _MADE}
    seconds = dict(steps.seconds)
    apart = os.getpid() != planner
    notes: list[str] = []
    if apart:
        steps.note = notes.append
    run()
    made: dict[str, Any] = {name: {k: v for k, v in getattr(steps, name).items() if k not in before[name]} for name in _MADE}
    made["notes"] = notes
    if apart:
        made["_failed"] = {k: _portable(e) for k, e in made["_failed"].items()}
        made["_tp_plans"] = {k: _portable(p) if isinstance(p, Exception) else p for k, p in made["_tp_plans"].items()}
    made["seconds"] = {part: steps.seconds[part] - seconds[part] for part in ("tracing", "recomputing")}
    return made


def _portable(error: Exception) -> Exception:
    """A worker's failure as it travels back to the planner: Unsupported and AotError keep their
    kind and message (the search skips that mesh, or the command ends on that one line, as in one
    process; a subclass, whose constructor may take other arguments, as its base); anything else
    becomes a RuntimeError naming its type (an internal error either way)."""
    for kind in (Unsupported, AotError):
        if isinstance(error, kind):
            return error if type(error) is kind else kind(str(error))
    return RuntimeError(f"{type(error).__name__}: {error}")
