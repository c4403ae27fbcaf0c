"""Point-to-point transfers between pipeline stages: what the runner needs for a program's
`isend` / `irecv` nodes (torch.ops._c10d_functional) to run step after step.

Their peers are ranks within the named group (the pipeline group: a stage's position), so one
program serves every data-parallel replica of its stage. A transfer completes only once both
sides have issued it; the build issues every send as soon as its value exists and waits for them
at the end of the step, so no rank waits on a peer that is itself waiting (see FORMAT.md,
"Pipeline").

torch 2.13's CPU kernel of `isend` registers the send's work under the placeholder it returns and
under the sent tensor; `wait_tensor` on the placeholder pops only the first, so every step would
keep its sent activations alive for the rest of the process (measured: 100 sends of 1 MiB, +102
MiB). `install_send_kernel` replaces that kernel, for this process only, with one that registers
the work under the placeholder alone; the program waits each placeholder exactly once.
"""

from __future__ import annotations

import torch

P2P_OPS = ("isend", "irecv", "batch_p2p_ops")
_library = None


def is_point_to_point(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "_c10d_functional"
        and node.target._schema.name.split("::")[-1] in P2P_OPS
    )


def install_send_kernel() -> None:
    global _library
    if _library is not None:
        return
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops and their side effects)
    from torch._C._distributed_c10d import _register_work, _resolve_process_group

    def isend(tensor, dst, tag, group_name):
        work = _resolve_process_group(group_name).send([tensor], dst, tag)
        placeholder = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        _register_work(placeholder, work)
        return placeholder

    library = torch.library.Library("_c10d_functional", "IMPL")
    library.impl("isend", isend, "CPU")
    library.impl("isend", isend, "CUDA")
    _library = library
