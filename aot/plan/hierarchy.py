"""Where a hierarchical all_reduce pays: the two levels of a group and the price of each way.

A mesh axis's group that spans several nodes with the same number g > 1 of its ranks on each can
reduce in two levels (aot/passes/hierarchical.py): its `intra` sub-groups are its ranks on one
node, its `inter` sub-groups the ranks holding the same piece (the k-th rank of each node's part)
across nodes. Both the planner and the build decide per collective with `hierarchical_wins`, which
prices what the graph would actually issue: a reduce-scatter and an all-gather over the intra
sub-groups and an all_reduce of n/g bytes over the inter sub-groups, each with the algorithms the
backend runs, against the flat all_reduce over the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from aot.passes.hierarchical import SubGroups
from aot.plan import collectives
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh
from aot.plan.placement import Placement, distinct_groups

LEVELS = ("intra", "inter")


@dataclass(frozen=True)
class Levels:
    axis: str
    # physical ranks, ascending, one row per sub-group: each group's ranks on one node (intra), the
    # k-th of each node's part of a group (inter)
    intra: np.ndarray = field(compare=False)
    inter: np.ndarray = field(compare=False)
    # (level, kind) -> the distinct spans of that level's groups: a planner prices many all_reduce
    # sizes on one placement, and finding the spans walks every rank of the mesh
    _spans: dict = field(default_factory=dict, compare=False, repr=False)

    def spans(self, machine: Machine, level: str, kind: str) -> list:
        if (level, kind) not in self._spans:
            groups = distinct_groups(getattr(self, level), machine.per_node)
            self._spans[(level, kind)] = distinct_spans(machine, groups, kind)
        return self._spans[(level, kind)]

    @property
    def subgroups(self) -> SubGroups:
        return SubGroups(level_name(self.axis, "intra"), len(self.intra[0]), level_name(self.axis, "inter"))


def level_name(axis: str, level: str) -> str:
    return f"{Mesh.group_name(axis)}.{level}"


def levels(machine: Machine, placement: Placement, axis: str) -> Levels | None:
    """The two levels of `axis`'s groups, or None where they have none: a group inside one node,
    one rank per node, or nodes holding different numbers of a group's ranks."""
    if dict(zip(placement.axes, placement.shape)).get(axis, 1) <= 1:
        return None
    # every group's ranks ascending (a node's ranks are contiguous and before the next node's), as
    # an array: the groups of a mesh over 16,384 ranks, without per-rank Python work
    ranks = np.sort(placement.group_array(axis), axis=1)
    n = ranks.shape[1]
    width = int(np.count_nonzero(ranks[0] // machine.per_node == ranks[0, 0] // machine.per_node))
    if width < 2 or n % width or n // width < 2:
        return None
    pieces = ranks.reshape(len(ranks), n // width, width)  # [group, node, k-th of the node's part]
    nodes = pieces // machine.per_node
    if np.any(nodes != nodes[:, :, :1]) or np.any(nodes[:, 1:, 0] == nodes[:, :-1, 0]):
        return None  # some node holds another number of a group's ranks
    return Levels(axis, pieces.reshape(-1, width), pieces.transpose(0, 2, 1).reshape(-1, n // width))


def level_spans(machine: Machine, placement: Placement, name: str, kind: str) -> list:
    """The distinct spans (Machine.span) of the groups of a level "aot.<axis>.<level>" (the
    planner prices the split all_reduces of every mesh it searches). Raises ValueError as
    group_ranks does."""
    found, level = _named_level(machine, placement, name)
    return found.spans(machine, level, kind)


def group_ranks(placement: Placement, machine: Machine, name: str) -> list[list[int]]:
    """Physical rank lists of the groups a graph names: "aot.<axis>" or "aot.<axis>.<level>"."""
    axis, _, level = Mesh.axis_of(name).partition(".")
    if axis in placement.axes and not level:
        return placement.groups(axis)
    found, level = _named_level(machine, placement, name)
    return getattr(found, level).tolist()


def _named_level(machine: Machine, placement: Placement, name: str) -> tuple[Levels, str]:
    """(the levels of the axis, the level) a group name "aot.<axis>.<level>" names, the levels found
    once per placement (they walk every rank); ValueError where it names none."""
    axis, _, level = Mesh.axis_of(name).partition(".")
    if axis not in placement.axes:
        raise ValueError(f"group {name!r} names no axis of mesh {placement.axes}")
    key = ("levels", axis, machine)
    if key not in placement._cache:
        placement._cache[key] = levels(machine, placement, axis)
    found = placement._cache[key]
    if level not in LEVELS or found is None:
        raise ValueError(f"group {name!r}: axis {axis!r} has no {level!r} level on {machine.describe()}")
    return found, level


def distinct_spans(machine: Machine, groups: list[list[int]], kind: str) -> list:
    """The spans (Machine.span) of `groups`, each distinct one once."""
    spans = {}
    for g in groups:
        s = machine.span(g, kind)
        spans[(s.p, s.nodes, s.per_node, s.intra, s.inter, s.rails)] = s
    return list(spans.values())


def _seconds(machine: Machine, spans: list, kind: str, n: float, algorithms: tuple[str, ...]) -> float:
    """The cheapest of `algorithms` for `kind` of n bytes, each priced on the slowest of `spans`."""
    return min(max(machine.compute.collective_seconds(kind, a, s, n) for s in spans) for a in algorithms)


def hierarchical_seconds(machine: Machine, found: Levels, n: float, inter_algorithm: str | None = None) -> float:
    """What the three collectives of a hierarchical all_reduce of n bytes cost, with a CPU rank's
    per-collective stall for each one beyond the flat all_reduce's."""
    realizable = collectives.REALIZABLE.get(machine.backend, collectives.REALIZABLE["gloo"])
    g = len(found.intra[0])
    piece = -(-n // g)
    inter = (inter_algorithm,) if inter_algorithm else realizable["all_reduce"]
    seconds = (
        _seconds(machine, found.spans(machine, "intra", "reduce_scatter"), "reduce_scatter", piece * g, realizable["reduce_scatter"])
        + _seconds(machine, found.spans(machine, "inter", "all_reduce"), "all_reduce", piece, inter)
        + _seconds(machine, found.spans(machine, "intra", "all_gather"), "all_gather", piece * g, realizable["all_gather"])
    )
    if not machine.compute.overlaps_communication:  # cost_model.simulate adds the stall per blocking collective
        seconds += 2 * machine.compute.collective_stall_s
    return seconds


def flat_seconds(machine: Machine, placement: Placement, axis: str, n: float, algorithm: str | None = None) -> float:
    realizable = collectives.REALIZABLE.get(machine.backend, collectives.REALIZABLE["gloo"])
    key = ("flat all_reduce spans", axis, machine)  # the planner asks this of every all_reduce it may split
    if key not in placement._cache:
        placement._cache[key] = distinct_spans(machine, placement.distinct_groups(axis, machine.per_node), "all_reduce")
    return _seconds(machine, placement._cache[key], "all_reduce", n, (algorithm,) if algorithm else realizable["all_reduce"])


def chooser(machine: Machine, placement: Placement, mode: str = "auto", flat_algorithm: str | None = None) -> Callable[[str, int], SubGroups | None] | None:
    """For aot/passes/hierarchical.py: which all_reduces (by group name and bytes) to split.
    mode "auto": where the hierarchical form is cheaper; "always": wherever the group has levels;
    "never": none. `flat_algorithm`: the all_reduce algorithm a plan pinned (NCCL_ALGO), priced
    as the planner priced it; None: the best the backend runs."""
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"hierarchical mode {mode!r}")
    if mode == "never":
        return None
    found = {a: levels(machine, placement, a) for a, d in zip(placement.axes, placement.shape) if d > 1}
    found = {Mesh.group_name(a): lv for a, lv in found.items() if lv is not None}
    if not found:
        return None

    chosen: dict[tuple, SubGroups | None] = {}  # a deep step's blocks ask the same (group, bytes) again and again

    def choose(group: str, nbytes: int) -> SubGroups | None:
        key = (group, nbytes)
        if key not in chosen:
            lv = found.get(group)
            wins = lv is not None and (mode == "always" or hierarchical_wins(machine, placement, lv, nbytes, flat_algorithm))
            chosen[key] = lv.subgroups if wins and lv is not None else None
        return chosen[key]

    return choose


def hierarchical_wins(machine: Machine, placement: Placement, found: Levels, n: float, flat_algorithm: str | None = None) -> bool:
    return hierarchical_seconds(machine, found, n, flat_algorithm) < flat_seconds(machine, placement, found.axis, n, flat_algorithm)
