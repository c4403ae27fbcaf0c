"""Mesh placement: which physical GPU (torchrun rank) holds each mesh coordinate.

Physical ranks are ordered by `Machine.device_order()`: node by node, and inside a node so that
every island of fast links (an NVLink pair, an NVSwitch domain) is contiguous. A placement lays
the mesh's coordinates out row-major over that order with its axes taken in some order, the last
axis fastest: the last axis's groups fill the innermost islands, the first axis's groups stride
across nodes. Every order of the axes is priced with the collective cost model (each axis's
traffic as all_reduces over the spans its groups cross; the groups of one axis communicate at once,
so an axis costs what its slowest group costs) and the cheapest wins, the mesh's own order on a tie.
With traffic tp >> dp this puts tp inside NVLink/NVSwitch islands and dp across nodes.

Axes are names: dp, fsdp, tp or any other the mesh grows. `Placement` answers what the manifest
needs in physical ranks: each physical rank's mesh coordinates and each axis's groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from aot.plan import collectives
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh

# Relative traffic per axis when no graph says otherwise (bytes per step per rank, for ordering only):
# tensor parallel moves activations at every layer, FSDP gathers and scatters every parameter,
# data parallel reduces each gradient once.
DEFAULT_TRAFFIC = {"tp": 100.0, "sp": 100.0, "cp": 50.0, "ep": 30.0, "fsdp": 3.0, "dp": 1.0, "pp": 0.1}


@dataclass(frozen=True)
class Placement:
    axes: tuple[str, ...]          # the mesh's axes, in the mesh's order
    shape: tuple[int, ...]
    order: tuple[str, ...]         # the axes from outermost (across nodes) to innermost (inside islands)
    physical: tuple[int, ...]      # mesh rank (row-major over `axes`) -> physical rank

    def __post_init__(self):
        object.__setattr__(self, "_mesh_rank_of", {p: m for m, p in enumerate(self.physical)})

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def mesh_coords(self, mesh_rank: int) -> dict[str, int]:
        return Mesh(self.axes, self.shape).coords(mesh_rank)  # the mesh owns the row-major layout

    def mesh_rank(self, coords: dict[str, int]) -> int:
        return Mesh(self.axes, self.shape).rank_of(coords)

    def coords(self, physical_rank: int) -> dict[str, int]:
        """Mesh coordinates of the GPU torchrun numbers `physical_rank`."""
        return self.mesh_coords(self._mesh_rank_of[physical_rank])

    def groups(self, axis: str) -> list[list[int]]:
        """Physical ranks of every group along `axis`, in coordinate order."""
        others = [a for a in self.axes if a != axis]
        size = dict(zip(self.axes, self.shape))
        out = []
        for fixed in itertools.product(*(range(size[a]) for a in others)):
            base = dict(zip(others, fixed))
            out.append([self.physical[self.mesh_rank({**base, axis: i})] for i in range(size.get(axis, 1))])
        return out

    @property
    def identity(self) -> bool:
        return list(self.physical) == list(range(len(self.physical)))

    def to_json(self) -> dict:
        """The placement for manifests and `aot plan --json` (the rank map only when it is not the identity)."""
        out = {"axes_outer_to_inner": list(self.order), "identity": self.identity}
        if not self.identity:
            out["physical_rank_of_mesh_rank"] = list(self.physical)
        return out


def layout(machine: Machine, axes: tuple[str, ...], shape: tuple[int, ...], order: tuple[str, ...],
           devices: list[int] | None = None) -> Placement:
    """Coordinates row-major over `order` (last fastest), laid onto `devices` (default: the
    machine's device order, islands contiguous)."""
    devices = machine.device_order() if devices is None else list(devices)
    size = dict(zip(axes, shape))
    physical = [0] * math.prod(shape)
    for k, coord in enumerate(itertools.product(*(range(size[a]) for a in order))):
        c = dict(zip(order, coord))
        physical[_row_major(axes, shape, c)] = devices[k]
    return Placement(tuple(axes), tuple(shape), tuple(order), tuple(physical))


def _row_major(axes, shape, coords) -> int:
    rank = 0
    for axis, degree in zip(axes, shape):
        rank = rank * degree + coords.get(axis, 0)
    return rank


def axis_cost(machine: Machine, placement: Placement, axis: str, nbytes: float) -> float:
    """Seconds for one all_reduce of `nbytes` over `axis`: its slowest group, best algorithm."""
    if nbytes <= 0 or dict(zip(placement.axes, placement.shape)).get(axis, 1) <= 1:
        return 0.0
    worst = 0.0
    seen = set()
    for group in placement.groups(axis):
        span = machine.span(group, "all_reduce")
        key = (span.p, span.nodes, span.per_node, span.intra, span.inter, span.rails)
        if key in seen:
            continue
        seen.add(key)
        worst = max(worst, collectives.best("all_reduce", span, nbytes)[1])
    return worst


def place(machine: Machine, axes: tuple[str, ...], shape: tuple[int, ...],
          traffic: dict[str, float] | None = None, devices: list[int] | None = None) -> Placement:
    """The cheapest placement of a mesh on `machine` for the given per-axis traffic (bytes per
    step each rank sends over that axis; DEFAULT_TRAFFIC scaled to 1 MiB when not given)."""
    if math.prod(shape) != machine.world_size:
        raise ValueError(f"mesh of {math.prod(shape)} ranks on a machine of {machine.world_size}")
    traffic = traffic or {a: DEFAULT_TRAFFIC.get(a, 1.0) * 2**20 for a in axes}
    active = tuple(a for a, d in zip(axes, shape) if d > 1)
    fixed = tuple(a for a in axes if a not in active)
    best, best_cost = None, math.inf
    for perm in itertools.permutations(active):
        order = fixed + perm
        candidate = layout(machine, axes, shape, order, devices)
        cost = sum(axis_cost(machine, candidate, a, traffic.get(a, 0.0)) for a in active)
        # strictly cheaper wins; permutations start with the mesh's own order, so it wins ties
        if cost < best_cost * (1 - 1e-9):
            best, best_cost = candidate, cost
    return best
