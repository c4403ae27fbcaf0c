"""Mesh placement: which physical GPU (torchrun rank) holds each mesh coordinate.

Physical ranks are ordered by `Machine.device_order()`: node by node, and inside a node so that
every island of fast links (an NVLink pair, an NVSwitch domain) is contiguous. A placement lays
the mesh's coordinates out row-major over that order with its axes taken in some order, the last
axis fastest: the last axis's groups fill the innermost islands, the first axis's groups stride
across nodes. Every order of the axes is priced with the collective cost model (each axis's
traffic as all_reduces over the spans its groups cross; the groups of one axis communicate at once,
so an axis costs what its slowest group costs) and the cheapest wins, the mesh's own order on a tie.
With traffic tp >> dp this puts tp inside NVLink/NVSwitch islands and dp across nodes.

Only placements whose every group lists its ranks in ascending order are candidates: torch's
`new_group` sorts the ranks it is given, so a rank's position in a collective (its all_gather
piece, its reduce_scatter shard) is its position in the sorted group, and that must be its
coordinate along the axis. The identity layout always qualifies and is the fallback.

Axes are names: dp, fsdp, tp or any other the mesh grows. `Placement` answers what the manifest
needs in physical ranks: each physical rank's mesh coordinates and each axis's groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from aot.plan import collectives
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh
from runner.format.axes import DP, EP, FSDP, PP, TP

# Relative traffic per axis when no graph says otherwise (bytes per step per rank, for ordering only):
# tensor parallel moves activations at every layer, FSDP gathers and scatters every parameter,
# data parallel reduces each gradient once.
DEFAULT_TRAFFIC = {TP: 100.0, "sp": 100.0, "cp": 50.0, EP: 30.0, FSDP: 3.0, DP: 1.0, PP: 0.1}


@dataclass(frozen=True)
class Placement:
    axes: tuple[str, ...]  # the mesh's axes, in the mesh's order
    shape: tuple[int, ...]
    order: tuple[str, ...]  # the axes from outermost (across nodes) to innermost (inside islands)
    physical: tuple[int, ...]  # mesh rank (row-major over `axes`) -> physical rank
    _cache: dict[object, Any] = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cache", {})  # what the methods below computed, by what they were asked
        object.__setattr__(self, "_hash", hash((self.axes, self.shape, self.order, self.physical)))

    def __hash__(self) -> int:  # a search keys its caches by placement: hash 16,384 ranks once
        return self._hash

    def __getstate__(self) -> dict:
        """What a planning worker sends back with its plans (aot.plan.workers): not the cache, whose
        group lists and spans over 16,384 ranks made the plans of a mesh megabytes to send."""
        return {**self.__dict__, "_cache": {}}

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def mesh_coords(self, mesh_rank: int) -> dict[str, int]:
        return Mesh(self.axes, self.shape).coords(mesh_rank)  # the mesh owns the row-major layout

    def mesh_rank(self, coords: dict[str, int]) -> int:
        return Mesh(self.axes, self.shape).rank_of(coords)

    def coords(self, physical_rank: int) -> dict[str, int]:
        """Mesh coordinates of the GPU torchrun numbers `physical_rank`."""
        if "mesh_rank_of" not in self._cache:
            self._cache["mesh_rank_of"] = {p: m for m, p in enumerate(self.physical)}
        return self.mesh_coords(self._cache["mesh_rank_of"][physical_rank])

    def distinct_groups(self, axis: str, per_node: int) -> list[list[int]]:
        """One group of each shape along `axis`: groups holding the same local devices of other
        nodes cross the same links, so pricing one of them prices all (a mesh axis of 1024 ranks
        has a handful of shapes, not hundreds of groups)."""
        key = ("distinct", axis, per_node)
        if key not in self._cache:
            self._cache[key] = distinct_groups(self.group_array(axis), per_node)
        return self._cache[key]

    def groups(self, axis: str) -> list[list[int]]:
        """Physical ranks of every group along `axis`, in coordinate order (groups ordered by
        their other coordinates, row-major). Computed once per axis: a search asks often."""
        if axis not in self._cache:
            self._cache[axis] = self.group_array(axis).tolist()
        return self._cache[axis]

    def grid(self) -> np.ndarray:
        """The physical ranks as an array over the mesh (read-only: shared by every caller)."""
        if "grid" not in self._cache:
            grid = np.asarray(self.physical, dtype=np.int64).reshape(self.shape)
            grid.flags.writeable = False
            self._cache["grid"] = grid
        return self._cache["grid"]

    def group_array(self, axis: str) -> np.ndarray:
        """`groups(axis)` as an array, one row per group."""
        key = ("array", axis)
        if key not in self._cache:
            if axis not in self.axes:
                array = self.grid().reshape(-1, 1)
            else:
                # the rank map as an array over the mesh, `axis` last: each row is one group, the
                # rows in row-major order of the other coordinates
                i = self.axes.index(axis)
                array = np.moveaxis(self.grid(), i, -1).reshape(-1, self.shape[i])
            self._cache[key] = array
        return self._cache[key]

    @property
    def identity(self) -> bool:
        if "identity" not in self._cache:  # 16,384 ranks compared: once (every plan of a mesh writes its placement)
            self._cache["identity"] = self.physical == tuple(range(len(self.physical)))
        return self._cache["identity"]

    @property
    def ascending(self) -> bool:
        """Whether along every axis each group's ranks ascend with the coordinate, as torch orders a
        group's members (new_group sorts its ranks): only then does every collective exchange
        pieces in coordinate order."""
        grid = self.grid()
        return all(bool(np.all(np.diff(grid, axis=i) > 0)) for i, d in enumerate(self.shape) if d > 1)

    def reordered(self, axes: tuple[str, ...], shape: tuple[int, ...]) -> "Placement":
        """The same placement over the mesh written with `axes` in another order (axes of degree 1
        may be added or left out): every physical rank keeps its coordinates."""
        size = dict(zip(self.axes, self.shape))
        if {a: d for a, d in zip(axes, shape) if d > 1} != {a: d for a, d in size.items() if d > 1}:
            raise ValueError(f"mesh {dict(zip(axes, shape))} is not the placement's {size}")
        mesh = Mesh(tuple(axes), tuple(shape))
        physical = tuple(self.physical[self.mesh_rank(mesh.coords(m))] for m in range(mesh.world_size))
        order = tuple(a for a in axes if size.get(a, 1) <= 1) + tuple(a for a in self.order if a in axes and size[a] > 1)
        return Placement(tuple(axes), tuple(shape), order, physical)

    def to_json(self, rank_map: bool | None = None) -> dict:
        """The placement, axes outermost first, with the rank map: where it is not the identity
        (None: the manifest's `plan` entry), always (True: the manifest's `placement`, which the
        runner maps ranks with) or never (False: `aot plan --json`, whose hundreds of plans over
        16,384 ranks made 33 MB of rank maps; the build of a plan writes its map)."""
        out = {"axes_outer_to_inner": list(self.order), "identity": self.identity}
        if rank_map or (rank_map is None and not self.identity):
            out["physical_rank_of_mesh_rank"] = list(self.physical)
        return out


def distinct_groups(groups: np.ndarray, per_node: int) -> list[list[int]]:
    """One of each set of groups (rows of one size: an axis's, a level's) that differ only by whole
    nodes (the same local devices of other nodes: they cross the same links), in their first
    order. No per-group Python work: a mesh axis over 16,384 ranks is walked often."""
    shifted = groups - groups[:, :1] // per_node * per_node
    order = np.lexsort(shifted.T[::-1])  # equal rows next to each other, each run in first order
    ordered = shifted[order]
    starts = np.flatnonzero(np.concatenate(([True], np.any(ordered[1:] != ordered[:-1], axis=1))))
    return groups[np.sort(np.minimum.reduceat(order, starts))].tolist()


def layout(machine: Machine, axes: tuple[str, ...], shape: tuple[int, ...], order: tuple[str, ...], devices: list[int] | None = None) -> Placement:
    """Coordinates row-major over `order` (last fastest), laid onto `devices` (default: the
    machine's device order, islands contiguous)."""
    slots = np.asarray(machine.device_order() if devices is None else list(devices), dtype=np.int64)
    size = dict(zip(axes, shape))
    stride, step = {}, 1
    for axis, degree in reversed(list(zip(axes, shape))):
        stride[axis], step = step, step * degree
    # mesh ranks in the order `order` enumerates coordinates (row-major, last fastest); a search
    # over 16,384 ranks lays out a hundred candidates, so no per-coordinate Python work
    ranks = np.zeros(1, dtype=np.int64)
    for axis in order:
        ranks = (ranks[:, None] + np.arange(size[axis], dtype=np.int64) * stride[axis]).reshape(-1)
    physical = np.zeros(math.prod(shape), dtype=np.int64)
    physical[ranks] = slots[: len(ranks)]
    return Placement(tuple(axes), tuple(shape), tuple(order), tuple(physical.tolist()))


def _slowest(machine: Machine, spans: list, nbytes: float) -> float:
    """The most seconds any of `spans` takes for an all_reduce of `nbytes`, at its best algorithm."""
    worst = 0.0
    seen = set()
    for span in spans:
        key = (span.p, span.nodes, span.per_node, span.intra, span.inter, span.rails)
        if key in seen:
            continue
        seen.add(key)
        worst = max(
            worst, min(machine.compute.collective_seconds("all_reduce", a, span, nbytes) for a in collectives.ALGORITHMS["all_reduce"]) if span.p > 1 else 0.0
        )
    return worst


def _axis_groups(machine: Machine, size: int, stride: int, devices: tuple[int, ...] | str) -> tuple[bool, list]:
    """(whether its groups' ranks ascend with the coordinate, the spans of one of each kind of
    group) of a mesh axis of `size` whose coordinate steps `stride` places along `devices` (a
    layout's; "islands": the machine's device order, "identity": rank order) in a placement of
    every rank. An axis's groups are the same sets of ranks whatever the other axes are, given its
    size and stride: a search over 16,384 ranks tries six orders of a hundred meshes, with a few
    dozen (size, stride) among them."""
    key = (size, stride, devices)
    if key not in machine.axis_groups:
        world = machine.world_size
        if devices == "islands":
            laid: Sequence[int] = machine.device_order()
        elif devices == "identity":
            laid = range(world)
        else:
            assert not isinstance(devices, str), devices
            laid = devices
        slots = np.asarray(laid, dtype=np.int64)[:world]
        groups = slots[np.arange(world, dtype=np.int64).reshape(-1, size, stride).transpose(0, 2, 1).reshape(-1, size)]
        ascending = bool(np.all(np.diff(groups, axis=1) > 0))
        spans = [machine.span(group, "all_reduce") for group in distinct_groups(groups, machine.per_node)]
        machine.axis_groups[key] = (ascending, spans)
    return machine.axis_groups[key]


def traffic_of(sites) -> dict[str, float]:
    """Bytes per step each rank sends over each mesh axis: `sites`' (CommSite) `bytes`, by the
    axis their group belongs to (what `place` weighs the axes by)."""
    out: dict[str, float] = {}
    for c in sites:
        axis = Mesh.axis_of(c.group)
        out[axis] = out.get(axis, 0.0) + c.bytes
    return out


def place(
    machine: Machine, axes: tuple[str, ...], shape: tuple[int, ...], traffic: dict[str, float] | None = None, devices: list[int] | None = None
) -> Placement:
    """The cheapest placement of a mesh on `machine` for the given per-axis traffic (bytes per
    step each rank sends over that axis; DEFAULT_TRAFFIC scaled to 1 MiB when not given)."""
    if math.prod(shape) != machine.world_size:
        raise ValueError(f"mesh of {math.prod(shape)} ranks on a machine of {machine.world_size}")
    traffic = traffic or {a: DEFAULT_TRAFFIC.get(a, 1.0) * 2**20 for a in axes}
    size = dict(zip(axes, shape))
    active = tuple(a for a, d in zip(axes, shape) if d > 1)
    fixed = tuple(a for a in axes if a not in active)
    laid = tuple(devices) if devices is not None else "islands"
    best, best_cost = None, math.inf
    # the orders laid onto the devices, then the identity (each axis's groups as they would be:
    # the Placement is made for the one chosen only)
    candidates = [(fixed + perm, laid) for perm in itertools.permutations(active)] + [(tuple(axes), "identity")]
    for order, onto in candidates:
        groups = {a: _axis_groups(machine, size[a], math.prod(size[b] for b in order[order.index(a) + 1 :]), onto) for a in active}
        if not all(ascending for ascending, _ in groups.values()):  # torch would order some group's members otherwise than its coordinates
            continue
        cost = sum(_slowest(machine, groups[a][1], traffic.get(a, 0.0)) if traffic.get(a, 0.0) > 0 else 0.0 for a in active)
        # strictly cheaper wins; permutations start with the mesh's own order, so it wins ties,
        # and the identity (last) is there for a machine where no laid-out order qualifies
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = (order, onto), cost
    assert best is not None  # the identity always qualifies
    order, onto = best
    return identity(axes, shape) if onto == "identity" else layout(machine, axes, shape, order, devices)


def identity(axes: tuple[str, ...], shape: tuple[int, ...]) -> Placement:
    """Mesh rank r on physical rank r (row-major over the mesh's axes, the last fastest)."""
    return Placement(tuple(axes), tuple(shape), tuple(axes), tuple(range(math.prod(shape))))
