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


def drop_profiler_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    # Reverse order visits each exit before the enter whose value it consumes.
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in _PROFILER_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
