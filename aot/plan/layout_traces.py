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
from aot.plan.mesh import factorizations
from aot.plan.model_steps import ModelSteps, Unsupported, _key
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
    jobs = [(i, key, source, len(traced), os.getpid()) for i, (key, source) in enumerate(traced)]
    # each job's meshes: its own graph's and those of the graphs derived from it
    shapes = {key: [m for k in (key, *(other for other, _ in steps._derived.get(key, ()))) for m in meshes.get(k, ())] for key, _ in traced}
    started = time.perf_counter()
    spent = {"tracing": 0.0, "recomputing": 0.0, "pricing": 0.0}
    priced: dict = {}

    def work(job: tuple) -> dict[str, Any]:
        made = _trace(steps, *job)
        if price is not None:
            before = time.perf_counter()
            made["priced"] = price(shapes[job[1]])
            made["seconds"]["pricing"] = time.perf_counter() - before
        return made

    announce = lambda job: _announce(steps, job, len(shapes[job[1]]) if price is not None else 0)  # noqa: E731
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


def _announce(steps: ModelSteps, job: tuple, priced: int) -> None:
    """The note a trace job makes as it starts: what it traces, and how many meshes it prices after."""
    i, key, source, count, _ = job
    derived = len(steps._derived.get(key, ()))
    steps.note(
        f"tracing the step on {mesh_words(source)} ({i + 1} of {count})"
        + (f", {derived} more graph(s) derived from it" if derived else "")
        + (f", then pricing the {priced} mesh{'es' if priced != 1 else ''} read from {'them' if derived else 'it'}" if priced else "")
    )


def _trace(steps: ModelSteps, i: int, key: tuple, source: tuple, count: int, planner: int) -> dict[str, Any]:
    """Trace one layout class (`source`, and the graphs derived from it) into `steps`, and return
    what that added (the entries of _MADE, what it noted, and the seconds it took): in a worker
    (a process other than `planner`'s), those go back to the planner; in the planner's own
    process they are already there, and its notes said."""
    before = {name: set(getattr(steps, name)) for name in _MADE}
    seconds = dict(steps.seconds)
    apart = os.getpid() != planner
    notes: list[str] = []
    if apart:
        steps.note = notes.append
    try:
        steps._traced(*source)
    except Exception as e:  # noqa: BLE001  (raised again when the search asks for this graph)
        steps._failed[key] = e
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
