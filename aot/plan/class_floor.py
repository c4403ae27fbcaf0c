"""Layout classes that cannot rank first, left unpriced (issue #42).

A layout class (a tensor-parallel degree, with ep where there is one: aot.plan.layout_traces) is
traced cut to a few blocks, then its graphs are written out to the model's depth, with their
recomputing variants, and every mesh read from them is priced: most of a plan's time. Before
any of that, its cut trace says the least any of its plans can take: the step's compute ops,
each block's once and the middle block's once per block it stands for, each priced as the search
prices it (step_reading.node_op, cost_model.op_time). Every plan of the class runs at least
those ops (the passes after the cut trace's cleanup reorder ops, add collectives, packing and
recomputation; a wider or narrower fsdp axis resizes only flat tensors, whose ops, like views,
are left out here), one after another on its compute clock, so its step is at least their sum
(cost_model.simulate: the step is the later of the compute clock and the last collective).
Over the class's data-parallel ranks, that is a floor on its time per sample.

A class whose floor is over the time per sample of the two fastest meshes that fit, priced so
far, cannot rank first, nor give a default search a pipeline mesh to price (pipeline_search's
PIPELINE_SEEDS, the two best meshes without pp): its graphs are not written out and its meshes
are not priced. A floor needs a priced class to be judged against, so the search orders its work
(layout_traces.prefetch): the class without tp traced and priced whole first, while the other
workers trace the others cut; then each of those is written out and priced, judged as it starts,
between the graphs it writes out (`checkpoint`) and before it is priced. The workers share the
floors and the two fastest meshes (`shared`, `best`: memory they all see, made before they fork),
so a class traced cut by one worker is judged by another without tracing it again.

Which classes a plan leaves out then depends on the order the workers finish in, but what the
plan says does not: `unpriced` lists every class over the two fastest meshes of the finished
search, which are the same whatever was left out (a class left out had its floor over two meshes
priced before it; the two fastest are never left out), and drops the plans of such a class that
was priced anyway. The class of the mesh whose ranks are all data-parallel is always priced:
pipelines' time bounds read its graph (pipeline_search.pipeline_work).
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import operator
from typing import Any, Callable

from aot.plan.cost_model import op_time
from aot.plan.model_steps import Unsupported
from aot.plan.plans import Plan, per_sample_s
from aot.plan.repeated_blocks import KEEP, own_block
from aot.plan.step_reading import is_compute, node_op
from aot.plan.written_out import WritingStopped

# a floor is compared with margin to spare: its sum adds the ops in another order than the
# simulation, which rounds differently in the last bits
MARGIN = 1e-9
FASTEST = 2  # the meshes that fit a class must be slower than (pipeline_search.PIPELINE_SEEDS)


class CannotWin(Unsupported, WritingStopped):
    """The class's floor is over the fastest meshes that fit: its meshes are not priced (and its
    graphs, where they are being written out, are not finished)."""


def trace_floor(gm: Any, blocks: tuple[str, int], compute: Any) -> float:
    """The least seconds a step of the model at full depth can take, from its graph cut to KEEP
    blocks (the cut trace, cleaned up): its compute ops on shaped tensors, the middle block's
    own (its forward and backward) once more for each block the cut left out."""
    prefix, depth = blocks[0] + ".", blocks[1]
    every: list[float] = []
    middle: list[float] = []
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        op = node_op(node)
        if op.kind != "compute" or any(flat for _, _, flat in op.tensors):
            continue
        seconds = op_time(op, compute)
        every.append(seconds)
        if own_block(node, prefix) == 1:
            middle.append(seconds)
    add = functools.partial(functools.reduce, operator.add)
    return add(every, 0.0) + (depth - KEEP) * add(middle, 0.0)


class ClassBound:
    """The floors of a search's layout classes (`floors`: ModelSteps.class_floors, seconds a
    sample by class key, which the workers' traces add to) and the fastest meshes that fit,
    priced so far. `world_size`: the ranks; `compute`: the device model the search prices on;
    `class_of(axes, shape)`: the class key of a mesh without pp (ModelSteps.class_key)."""

    def __init__(self, world_size: int, compute: Any, floors: dict[tuple, float], class_of: Callable[[tuple, tuple], tuple]):
        self.world_size, self.compute, self.floors, self.class_of = world_size, compute, floors, class_of
        # seconds a sample of the FASTEST fastest meshes that fit, shared with the forked workers
        self.best = multiprocessing.Array("d", [math.inf] * FASTEST)
        self.slots: dict[tuple, int] = {}  # class key -> its place in `shared` (`share`)
        self.shared: Any = None  # each class's floor, once a worker has traced it (NaN before)
        self.judging: tuple | None = None  # (key, derived) of the class this process writes out (`checkpoint`)

    @staticmethod
    def judged(key: tuple) -> bool:
        """Whether class `key` may be left out: all but the class of the mesh whose ranks are all
        data-parallel (tp=1 without ep), whose graph the pipelines' time bounds read."""
        return key[2] > 1 or len(key) > 3

    def share(self, keys: list[tuple]) -> None:
        """Room for the floors of classes `keys`, seen by the workers forked after this (a class
        traced cut by one worker is judged by another: layout_traces.prefetch)."""
        self.slots = {key: i for i, key in enumerate(keys)}
        self.shared = multiprocessing.Array("d", [math.nan] * max(1, len(keys)))

    def floor(self, steps: Any, key: tuple, captured: Any, derived: list) -> float:
        """Class `key`'s floor, seconds a sample, from its cut trace `captured`: recorded for it
        and the graphs derived from it (`derived`: their (key, mesh)), and shared with the other
        workers."""
        floor = trace_floor(captured.graph, steps.blocks, self.compute) / (self.world_size // key[2])
        self._record(key, derived, floor)
        if key in self.slots:
            self.shared[self.slots[key]] = floor
        return floor

    def _record(self, key: tuple, derived: list, floor: float) -> None:
        for k in [key, *(other for other, _ in derived)]:
            self.floors[k] = floor

    def checkpoint(self, steps: Any, captured: Any = None) -> None:
        """Raise CannotWin where the class this process writes out (`judging`: its key and the
        (key, mesh) of the graphs derived from it) cannot rank first now: its floor (as recorded
        or shared, else from its cut trace `captured`) is over the fastest meshes that fit priced
        so far. Its WRITE job calls it before tracing, the writer between graphs (so a class
        another worker's pricing shows cannot win stops within a graph's passes), the job again
        before pricing. Each of its keys then fails with the CannotWin raised, which the search
        does not list (`unpriced` lists the class)."""
        if self.judging is None:
            return
        key, derived = self.judging
        floor = self.floors.get(key)
        if floor is None and key in self.slots and not math.isnan(self.shared[self.slots[key]]):
            floor = self.shared[self.slots[key]]
            self._record(key, derived, floor)
        if floor is None and captured is not None:
            floor = self.floor(steps, key, captured, derived)
        with self.best.get_lock():
            if floor is None or floor <= self.best[FASTEST - 1] * (1 + MARGIN):
                return
        stop = CannotWin("slower than the fastest meshes that fit, from its compute alone")
        for k in [key, *(other for other, _ in derived)]:
            steps._failed[k] = stop
        named = f"tp={key[2]}{f',ep={key[3]}' if len(key) > 3 else ''}"
        steps.note(f"{named}: not written out or priced, its compute ops alone slower per sample than {FASTEST} meshes priced")
        raise stop

    def publish(self, priced: dict[tuple, tuple[list[Plan], list[str]]]) -> None:
        """Merge the fastest meshes that fit among `priced` ({mesh: (plans, skipped)}) into `best`."""
        mine = _fastest({mesh: plans for mesh, (plans, _) in priced.items()})
        with self.best.get_lock():
            self.best[:] = sorted([*self.best[:], *mine])[:FASTEST]

    def unpriced(self, plans: list[Plan], meshes: list[tuple], axes: tuple) -> tuple[list[Plan], list[str]]:
        """(`plans` without those of classes that cannot rank first, a line for each such class):
        those whose floor is over the FASTEST meshes that fit among `plans`, whether their meshes
        were priced or not. `meshes`: the search's meshes without pp."""
        by_mesh: dict[tuple, list[Plan]] = {}
        for p in plans:
            if p.pipeline is None:
                by_mesh.setdefault(tuple(p.shape), []).append(p)
        fastest = _fastest(by_mesh)
        out = {key: floor for key, floor in self.floors.items() if len(fastest) == FASTEST and floor > fastest[-1] * (1 + MARGIN)}
        if not out:
            return plans, []
        counts: dict[tuple, list] = {}  # (tp, ep...) -> [meshes, floor]
        for shape in meshes:
            try:
                key = self.class_of(axes, shape)
            except Unsupported:
                continue
            if key in out:
                entry = counts.setdefault((key[2], *key[3:]), [0, out[key]])
                entry[0] += 1
        lines = [
            f"tp={named[0]}{f',ep={named[1]}' if len(named) > 1 else ''} ({count} mesh{'es' if count > 1 else ''} without pp): not priced, "
            f"its step's compute ops alone take {floor * 1e3:.4g} ms a sample, more than each of the {FASTEST} fastest meshes "
            "that fit takes (--axes prices every mesh of the axes it names)"
            for named, (count, floor) in sorted(counts.items())
        ]
        kept = [p for p in plans if p.pipeline is not None or self.class_of(axes, tuple(p.shape)) not in out]
        return kept, lines


def _fastest(by_mesh: dict[tuple, list[Plan]]) -> list[float]:
    """The FASTEST least seconds a sample among meshes' plans that fit (fewer where fewer fit)."""
    least = [min(per_sample_s(p) for p in plans if p.fits) for plans in by_mesh.values() if any(p.fits for p in plans)]
    return sorted(least)[:FASTEST]
