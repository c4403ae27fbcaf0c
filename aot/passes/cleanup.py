"""Remove what tracing records but a static step has no use for.

torch.optim wraps `step()` in a profiler record_function; in a captured graph that becomes a
pair of profiler ops (and an opaque RecordFunction value) that do nothing but cost a call.
"""

from __future__ import annotations

import torch

_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


# Collectives with an autograd formula, used only so tracing can differentiate through them; at
# run time the graph is already differentiated and the plain collective does the same work.
_AUTOGRAD_COLLECTIVES = {
    torch.ops._c10d_functional_autograd.all_gather_into_tensor.default: torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default: torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default: torch.ops._c10d_functional.all_to_all_single.default,
}


def plain_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _AUTOGRAD_COLLECTIVES:
            node.target = _AUTOGRAD_COLLECTIVES[node.target]
    gm.recompile()
    return gm


def drop_profiler_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    # Reverse order visits each exit before the enter whose value it consumes.
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in _PROFILER_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
