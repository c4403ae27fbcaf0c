"""What a captured graph says about its values: the loss, storages, in-place writes. Read by the
capture's own analyses (aot/capture/replicas.py) and by the passes (aot/passes/graph_utils.py)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# The operator namespaces of torch's functional collectives (the autograd variants too).
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


def loss_node(graph: torch.fx.Graph) -> torch.fx.Node | None:
    """The step's loss: the program's first output is its detached value. Every node after the
    loss belongs to backward or to the optimizer update; the loss and every node before it, to
    forward."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    first = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else None
    if not isinstance(first, torch.fx.Node):
        return None
    loss = first.args[0] if first.target == torch.ops.aten.detach.default else first
    return loss if isinstance(loss, torch.fx.Node) else None


def storage_key(t: torch.Tensor):
    """What identifies the storage a tensor lives in (tensors sharing one are one allocation)."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except Exception:
        return id(t)


def written_values(node: torch.fx.Node) -> list:
    """The arguments an op writes in place: those its schema marks mutable (`Tensor(a!) self`), and
    the running statistics aten.native_batch_norm updates in training mode, which its schema does
    not mark (plain BatchNorm's, which then differ between data-parallel ranks, and which a
    recomputed batch norm would update twice)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    if node.target is torch.ops.aten.native_batch_norm.default and len(node.args) > 5 and node.args[5] is True:
        return [node.args[3], node.args[4]]
    return [
        node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        for i, arg in enumerate(schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]
