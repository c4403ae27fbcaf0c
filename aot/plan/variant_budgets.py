"""The activation budgets a deep model's graph that may not fit is priced recomputing at, chosen
so that its variant can be written out from the model cut to a few blocks (issue #42).

A budget is a fraction of the saved activation bytes (`aot build --activation-budget`):
aot.passes.recompute.by_budget checkpoints the fewest first layers it must, then takes single
values cheapest per byte until the step keeps no more than the budget. Values alike (the same op
in every block) cost the same per byte, so the greedy takes them one after another; a budget that
stops inside such a run keeps some blocks' values and not others', a choice no fixed number of
blocks repeats. The planner prices budgets that stop between runs instead (Breakpoints): then the
blocks after the first k checkpointed ones all recompute the same values at any depth, and the deep
model's variant is written out (aot.plan.step_synthesis) from the variants of the model cut to
k + 4, k + 5 and k + 6 blocks, its first k checkpointed, as its step without recomputation is.

Two budgets, as the planner has always priced:
- the first: the least first layers and runs of values that keep at most FIRST_TARGET of the
  bytes (the run that crosses it taken whole);
- the least: every layer checkpointed and every single value beside them.

Each is stated as the shortest decimal in the middle of the range of budgets that make by_budget
choose it at the model's own depth, read from the figures of the model cut to three depths along
the line through them (they must be on it: NotPeriodic otherwise): what `aot plan` prints is what
`aot build --activation-budget` chooses.

A graph whose variants cannot be written out (a model of too few blocks, or one whose figures are
off the line) is made from every block and priced at FIRST_TARGET itself and at the smallest
feasible budget (`every_block_variants`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from aot.passes.recompute import Breakpoints
from aot.plan.step_synthesis import BASE

FIRST_TARGET = 0.5  # the first budget priced keeps at most about this fraction of the saved bytes


def most_leading(depth: int) -> int:
    """The most first layers checkpointed of a variant written out for a model of `depth` blocks:
    its shallow steps are as many blocks deeper, and the deepest of them stays within half the
    model's depth (deeper, writing it out saves little over pricing every block)."""
    return depth // 2 - BASE - 1


class NotPeriodic(Exception):
    """The budgets' choices at the model's depth cannot be read from a few depths (the message says why)."""


@dataclass(frozen=True)
class Cut:
    """What a budget makes by_budget choose: the first `layers` layers checkpointed (None: every
    layer) and the runs of single values up to `run` taken (None: every value there is)."""

    layers: int | None
    run: int | None


EVERY_LAYER = Cut(None, None)


def along(figures: dict[int, int], depth: int, what: str) -> int:
    """A figure at `depth` on the line through its values at three consecutive depths."""
    (n, a), (_, b), (_, c) = sorted(figures.items())
    if b - a != c - b:
        raise NotPeriodic(f"{what} grows by {b - a} then {c - b} bytes a block")
    return a + (depth - n) * (b - a)


def _same(values: list, what: str):
    if any(v != values[0] for v in values):
        raise NotPeriodic(f"{what} differs with depth")
    return values[0]


@dataclass(frozen=True)
class Deep:
    """by_budget's figures at the model's depth, from those of the model cut to three depths."""

    depth: int
    saved: int
    known: tuple  # kept bytes with the first k layers and every value beside them, for the k the shallow depths show alike
    step: int  # the bytes checkpointing one more middle layer frees beyond those
    every: int  # kept bytes with every layer checkpointed (and every value beside them)
    all_but_last: int  # with every layer but the last
    least_beside: int | None  # the least bytes a value taken beside every layer frees

    @classmethod
    def of(cls, shallow: dict[int, Breakpoints], depth: int) -> "Deep":
        on = lambda f, what: along({n: f(n, bp) for n, bp in shallow.items()}, depth, what)  # noqa: E731
        lowest, deepest = min(shallow), max(shallow)
        # the first k layers' bytes are the same at every depth while the last ones are not among
        # them (k <= lowest - 2); beyond, each middle layer frees what the one before did
        known = tuple(on(lambda n, bp, k=k: bp.layered[k], f"the bytes kept at {k} layers") for k in range(lowest - 1))
        step = known[-2] - known[-1]
        at_deepest = shallow[deepest].layered
        for k in range(lowest - 2, deepest - 2):
            if at_deepest[k] - at_deepest[k + 1] != step:
                raise NotPeriodic(f"layer {k} frees {at_deepest[k] - at_deepest[k + 1]} bytes, the one before {step}")
        beside = [_least(bp.runs(len(bp.layered) - 1)) for bp in shallow.values()]
        return cls(
            depth,
            on(lambda n, bp: bp.saved_bytes, "the saved bytes"),
            known,
            step,
            on(lambda n, bp: bp.layered[-1], "the bytes kept at every layer"),
            on(lambda n, bp: bp.layered[-2], "the bytes kept at all layers but the last"),
            _same(beside, "the least value beside every layer"),
        )

    def leading(self, k: int) -> int:
        """The bytes kept with the first k layers checkpointed (k <= depth - 2: the last two
        layers are not middle ones) and every value beside them."""
        assert k <= self.depth - 2
        return self.known[k] if k < len(self.known) else self.known[-1] - (k - len(self.known) + 1) * self.step

    def budget(self, cut: Cut, runs: tuple | list = ()) -> float:
        """The budget that makes by_budget choose `cut` at the model's depth (`runs`: the runs of
        values at the model's depth with cut.layers checkpointed)."""
        return _window(cut, runs, self.leading, self.every, self.all_but_last, lambda: self.least_beside, self.saved)[0]

    def first_layers(self, target: float = FIRST_TARGET) -> int | None:
        """How many first layers by_budget checkpoints at `target` (None: it cannot reach it).
        Raises NotPeriodic where that is all layers but one or two."""
        if self.every > target * self.saved:
            return None
        for k in range(self.depth - 1):
            if self.leading(k) <= target * self.saved:
                return k
        raise NotPeriodic(f"the budget {target:g} checkpoints all of the {self.depth} layers but one or none")


def _least(runs: list) -> int | None:
    return min((run[3] for run in runs), default=None)


def _runs_on(by_point: dict, deep: Callable[[str, dict], int], what: str) -> list[tuple]:
    """Breakpoints.runs at the model's depth from the runs at a few shallow points, each count
    and kept bytes by `deep` (from its values at the points), rates and least values the same."""
    counts = {len(r) for r in by_point.values()}
    if len(counts) != 1:
        raise NotPeriodic(f"the single values come in {sorted(counts)} runs {what}")
    out = []
    for g in range(counts.pop()):
        at = {p: runs[g] for p, runs in by_point.items()}
        out.append(
            (
                _same([r[0] for r in at.values()], f"run {g}'s seconds per byte"),
                deep(f"run {g}'s values", {p: r[1] for p, r in at.items()}),
                deep(f"the bytes kept after run {g}", {p: r[2] for p, r in at.items()}),
                _same([r[3] for r in at.values()], f"run {g}'s least value"),
            )
        )
    return out


def deep_runs(shallow: dict[int, Breakpoints], layers: int, depth: int) -> list[tuple]:
    """Breakpoints.runs(layers) at `depth`, from the model cut to three depths."""
    return _runs_on({n: bp.runs(layers) for n, bp in shallow.items()}, lambda what, f: along(f, depth, what), "at different depths")


def deep_runs_two(shallow: dict[tuple[int, int], Breakpoints], first: int, rest: int) -> list[tuple]:
    """Breakpoints.runs(first) of a model of first + rest blocks, from the model cut to (a, b)
    blocks (a first layers checkpointed, b after them) at the four points of
    aot.plan.step_synthesis.synthesize_two: each figure on the plane through three of them, and
    the fourth on it too."""

    def plane(what: str, f: dict) -> int:
        (a, b) = max(f)
        top, fewer, shorter, both = f[(a, b)], f[(a - 1, b)], f[(a, b - 1)], f[(a - 1, b - 1)]
        if both != fewer + shorter - top:
            raise NotPeriodic(f"{what} does not grow alike with each region's blocks")
        return top + (first - a) * (top - fewer) + (rest - b) * (top - shorter)

    return _runs_on({p: bp.runs(p[0]) for p, bp in shallow.items()}, plane, "in the two regions")


def first_cut(layers: int, runs: list, saved: int, target: float = FIRST_TARGET) -> Cut:
    """The cut of a budget about `target` with `layers` first layers checkpointed: the runs up to
    the one after which at most `target` of `saved` is kept."""
    for g, run in enumerate(runs):
        if run[2] <= target * saved:
            return Cut(layers, g)
    return Cut(layers, len(runs) - 1 if runs else None)


ROOM_SLACK = 0.03  # of the memory limit, left free at the widest mesh by the roomier budget's estimate


def roomier_target(limit, plain, first, first_budget: float, widest: Callable) -> float | None:
    """A budget above the first (`first_budget`, the graph `first` recomputing at it; `plain`
    recomputing nothing) at which plans of the widest mesh read from them may still fit the
    planner's MemoryLimit `limit`, or None: on the line through the two graphs' peaks at that
    mesh (`widest(graph)`, the default bucket size), ROOM_SLACK of the limit left. The first
    budget is a fixed fraction; where its plans fit with room (Llama-3-8B over 128 nodes: 35 GiB
    of 71.7), the fastest plan that fits recomputes less (there, 0.612: 5.66 s a step, not 6.24). Where
    `plain` fits there, or the line leaves no budget worth another variant, None."""
    peak = lambda graph: limit.default_peak(widest(graph))  # noqa: E731
    whole, at_first = peak(plain), peak(first)
    if whole <= limit.bytes or whole <= at_first:
        return None
    target = first_budget + (limit.bytes * (1 - ROOM_SLACK) - at_first) * (1 - first_budget) / (whole - at_first)
    return target if first_budget + 0.05 <= target < 0.99 else None


def budget(kept: int, more: int | None, fewer: float, saved: int) -> float:
    """The budget (a fraction of `saved`) that makes by_budget keep `kept` bytes: at least that,
    under it plus `more` (the least value the cut's last run frees: less, and the run is not
    finished; None: no value) and under `fewer` (what one layer fewer keeps: there by_budget stops
    at fewer layers); the shortest decimal in the middle half of that range."""
    most = min(kept + (more if more is not None else math.inf), fewer, saved)
    if not most > kept:
        raise NotPeriodic("no budget makes by_budget choose it")
    a, b = (kept + (most - kept) / 4) / saved, (kept + 3 * (most - kept) / 4) / saved
    for digits in range(1, 16):
        scale = 10**digits
        shortest = math.ceil(a * scale) / scale
        if shortest <= b:
            return shortest
    return (a + b) / 2


def shallow_budget(cut: Cut, bp: Breakpoints) -> tuple[float, int]:
    """(the budget, the bytes kept) of `cut` on the model cut to a few blocks, whose Breakpoints are `bp`."""
    runs = bp.runs(cut.layers) if cut.layers is not None else []
    least_beside = lambda: _least(bp.runs(len(bp.layered) - 1))  # noqa: E731
    return _window(cut, runs, bp.layered.__getitem__, bp.layered[-1], bp.layered[-2], least_beside, bp.saved_bytes)


def _window(cut: Cut, runs: tuple | list, leading: Callable, every: int, all_but_last: int, least_beside: Callable, saved: int) -> tuple[float, int]:
    """(the budget, the bytes kept) of `cut` on a graph whose figures are these: `leading(k)` the
    bytes kept with the first k layers checkpointed and every value beside them, `every` and
    `all_but_last` those with every layer and all but the last, `least_beside()` the least a value
    taken beside every layer frees, `runs` the runs of values with cut.layers checkpointed."""
    fewer: float
    if cut.layers is None:
        kept, more, fewer = every, least_beside(), all_but_last
    else:
        kept, more = (leading(cut.layers), None) if cut.run is None else runs[cut.run][2:4]
        fewer = leading(cut.layers - 1) if cut.layers else math.inf
    return budget(kept, more, fewer, saved), kept


def every_block_variants(gm, finish: Callable, cost: Callable, limit, sharded: bool, roomier: Callable | None = None) -> list[tuple[float, Any]]:
    """[(budget, the step recomputing at it)] of a graph made from every block (where its variants
    cannot be written out from a few), the budgets the planner has always priced there: FIRST_TARGET,
    and where that does not fit but recomputing more might (or is below what can be reached), the
    smallest feasible one. `finish(gm, budget)` is the analyzed step as the build given
    --activation-budget makes it, changing `gm` (each budget but the last is given a copy), raising
    AotError below the smallest feasible budget; `cost(node)` prices a node; `limit` is the
    planner's aot.plan.search.MemoryLimit; `sharded`: `gm` has an fsdp axis (MemoryLimit.more_may_help);
    `roomier(budget, graph)`: a budget above the first worth a variant too (roomier_target), or None."""
    from aot.errors import AotError
    from aot.passes.graph_utils import copy_graph
    from aot.passes.recompute import by_budget
    from aot.plan.recompute import smallest_fraction

    def variant(fraction: float, last: bool = False):
        try:
            return fraction, finish(gm if last else copy_graph(gm), fraction)
        except AotError:
            return None  # the budget is below the smallest feasible

    variants = []
    first = variant(FIRST_TARGET)
    if first is not None:
        variants.append(first)
        target = roomier(*first) if roomier is not None else None
        if target is not None:  # stated as by_budget takes it: the graph of every block needs no window
            variants += [v for v in [variant(math.floor(target * 100) / 100)] if v is not None]
    if first is None or limit.more_may_help(first[1], sharded):
        least = smallest_fraction(by_budget(gm.graph, 0.0, cost).fraction)
        if least < FIRST_TARGET or first is None:
            variants += [v for v in [variant(least, last=True)] if v is not None]
    return sorted(variants, key=lambda v: v[0])
