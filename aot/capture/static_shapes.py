"""One static graph holds fixed shapes: a step whose trace made a tensor whose size depends on
values (torch.where with one argument, nonzero, boolean-mask indexing: a mixture of experts that
loops over the tokens each expert got) is refused here, in one line naming the op and the module
that called it, before a pass or the cost model meets a size it cannot read."""

from __future__ import annotations

import torch

from aot.capture.module_calls import MODULE_CALLS
from aot.errors import AotError


def _data_dependent(val) -> bool:
    tensors = val if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) and d.node.expr.free_symbols for d in t.shape) for t in tensors)


def refuse_data_dependent_shapes(graph: torch.fx.GraphModule, where: str) -> None:
    """AotError naming the first node whose value has a size known only from values."""
    for node in graph.graph.nodes:
        if node.op == "call_function" and _data_dependent(node.meta.get("val")):
            calls = node.meta.get("custom", {}).get(MODULE_CALLS, ())
            module = f" in {calls[-1][0]}" if calls and calls[-1][0] else ""
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            raise AotError(
                f"{where}: {name}{module} makes a tensor whose size depends on values (torch.where with one argument, "
                f"nonzero, boolean-mask indexing), which one static graph cannot hold; keep shapes fixed (mask with "
                f"multiplication or torch.where(cond, a, b), pad to a capacity)"
            )
