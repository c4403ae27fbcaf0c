"""The mesh's axes: their names as the artifact format spells them, and what each one means.

The one place that names them. A manifest's `mesh.axes`, `sharding.axis`, `tensor_parallel.axis`,
`pipeline.axis` and the process groups (`aot.<axis>`) use these names; the build (aot/) and the
runner ask this module for them and for their roles, so adding an axis means adding it here and
writing the code that implements it.

- `dp`: data parallel. Each rank its own samples, whole parameters; gradients averaged.
- `fsdp`: fully sharded data parallel (ZeRO-3). Each rank its own samples and a flat shard of
  every parameter and of its optimizer state, gathered for use.
- `tp`: tensor parallel. The same samples; the split layers' weights sliced (artifacts/FORMAT.md,
  "Tensor-parallel layout").
- `pp`: pipeline parallel, always the mesh's first axis. Each rank its stages.
- `ep`: expert parallel. Each rank its own samples and E/N of every mixture-of-experts layer's
  experts (a slice along the experts' dimension, artifacts/FORMAT.md "Expert-parallel layout");
  tokens travel to the rank holding their expert and back by all_to_all. The other parameters as
  under dp (whole, gradients averaged).
"""

from __future__ import annotations

DP, FSDP, TP, PP, EP = "dp", "fsdp", "tp", "pp", "ep"
# every axis a mesh may have, in the order a pipeline mesh lists them (pp first)
AXES = (PP, DP, FSDP, EP, TP)
# axes whose ranks see different samples (tensor-parallel ranks share a batch; pipeline ranks a microbatch's flow)
DATA_AXES = (DP, FSDP, EP)


def group_name(axis: str) -> str:
    """The process-group name a program uses for this axis's collectives; the runner binds it."""
    return f"aot.{axis}"
