"""The device mesh: named parallel axes and their degrees, the one place that knows them.

A strategy string names the axes as axis=degree pairs ("dp=4"). Ranks are laid out row-major
over the axes in the order given, so the last axis varies fastest. Everything else asks the mesh
for an axis's size, the rank lists of its groups, a rank's coordinates and the name its process
group carries inside the traced graph.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from aot.errors import AotError
from runner.format.artifact import mesh_coords
from runner.format.axes import DATA_AXES, DP, EP, FSDP, PP, TP, group_name

# The axes' names and roles are runner/format/axes.py's (the artifact format spells them)
SUPPORTED_AXES = (DP, FSDP, TP)
# Axes the planner searches (pipeline meshes where they could win: aot.plan.search)
PLANNED_AXES = (*SUPPORTED_AXES, PP)
# Axes a build takes: expert parallelism is built as asked, not searched yet
BUILD_AXES = (*PLANNED_AXES, EP)


@dataclass(frozen=True)
class Mesh:
    axes: tuple[str, ...]
    shape: tuple[int, ...]

    @classmethod
    def parse(cls, strategy: str | None, world_size: int | None) -> "Mesh":
        """The mesh a strategy names; `world_size` None takes it from the degrees."""
        if world_size is not None and world_size < 1:
            raise AotError(f"--world-size must be at least 1, got {world_size}")
        if not strategy:
            return cls((DP,), (1 if world_size is None else world_size,))
        axes, shape = [], []
        for part in strategy.split(","):
            name, sep, degree = part.strip().partition("=")
            if not sep or not degree.strip().isdigit() or int(degree) < 1:
                raise AotError(f"--strategy {strategy!r}: expected axis=degree pairs such as dp={world_size}")
            name = name.strip()
            if name not in BUILD_AXES:
                raise AotError(f"--strategy {strategy!r}: axis {name!r} is not supported yet (supported: {', '.join(BUILD_AXES)})")
            if name in axes:
                raise AotError(f"--strategy {strategy!r}: axis {name!r} is given twice")
            axes.append(name)
            shape.append(int(degree))
        if world_size is not None and math.prod(shape) != world_size:
            raise AotError(f"--strategy {strategy!r}: degrees multiply to {math.prod(shape)}, not the world size {world_size}")
        return cls(tuple(axes), tuple(shape))

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, axis: str) -> int:
        return self.shape[self.axes.index(axis)] if axis in self.axes else 1

    def coords(self, rank: int) -> dict[str, int]:
        return mesh_coords(self.axes, self.shape, rank)  # the artifact format's row-major layout

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis, degree in zip(self.axes, self.shape):
            rank = rank * degree + coords.get(axis, 0)
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Rank lists of every group along `axis` (ranks that differ only in that coordinate)."""
        others = [a for a in self.axes if a != axis]
        result = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            base = dict(zip(others, fixed))
            result.append([self.rank_of({**base, axis: i}) for i in range(self.size(axis))])
        return result

    @property
    def data_parallel_size(self) -> int:
        return math.prod(self.size(a) for a in DATA_AXES)

    @staticmethod
    def group_name(axis: str) -> str:
        """The process-group name a traced graph uses for this axis; the runner binds it."""
        return group_name(axis)

    @staticmethod
    def axis_of(group: str) -> str:
        """What follows "aot." in a graph's group name: the axis ("dp"), or an axis's level
        ("dp.intra", aot/plan/hierarchy.py)."""
        return group[len("aot.") :] if group.startswith("aot.") else group

    def describe(self) -> str:
        return ",".join(f"{a}={d}" for a, d in zip(self.axes, self.shape))


def factorizations(world_size: int, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Every way to give `axes` degrees whose product is world_size (degree 1 allowed)."""
    if not axes:
        return [()] if world_size == 1 else []
    out = []
    for d in range(1, world_size + 1):
        if world_size % d == 0:
            out += [(d, *rest) for rest in factorizations(world_size // d, axes[1:])]
    return out
