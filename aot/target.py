"""What a step is compiled for: the mesh (its axes and degrees), the dtypes it computes in, and
whether tensor parallelism also splits the sequence.

The one value the build, the pipeline build and the planner hand the compile path
(aot/compile_step.py). The axes' names and their process groups' names are runner/format/axes.py's (the
artifact format spells them); code asks the target for an axis's degree or group, never builds a
group itself, so an axis added lands here, in runner/format/axes.py and where it is implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

from aot.capture.precision import Precision
from aot.capture.step import Group
from aot.plan.mesh import BUILD_AXES, Mesh
from runner.format.axes import group_name

FULL_PRECISION = Precision()  # fp32 throughout


@dataclass(frozen=True)
class Target:
    mesh: Mesh
    precision: Precision = FULL_PRECISION
    sequence_parallel: bool = False  # with tp: the residual stream split along the sequence
    moe_capacity_factor: float | None = None  # with ep: rows per expert as a multiple of an even split (None: dropless)

    @classmethod
    def of(
        cls, degrees: dict[str, int], precision: Precision = FULL_PRECISION, sequence_parallel: bool = False, moe_capacity_factor: float | None = None
    ) -> "Target":
        """The target of a mesh given by its degrees (the planner's meshes), axes in BUILD_AXES order."""
        axes = tuple(a for a in BUILD_AXES if a in degrees)
        return cls(Mesh(axes, tuple(degrees[a] for a in axes)), precision, sequence_parallel, moe_capacity_factor)

    def group(self, axis: str) -> Group | None:
        """The axis's process group as the traced graph names it; None where the axis has one rank."""
        size = self.mesh.size(axis)
        return Group(group_name(axis), size) if size > 1 else None
