"""Graphs compared node for node: what each node is (op, name, target, arguments) and the value it
makes (shape, strides, offset, dtype), so two traces are equal only where every node is."""

from __future__ import annotations

import torch


def graph_nodes(gm: torch.fx.GraphModule) -> list:
    def meta(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype
        if isinstance(v, (list, tuple)):
            return [meta(x) for x in v]
        return "script object" if isinstance(v, torch.ScriptObject) else repr(v)

    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs), meta(n.meta.get("val"))) for n in gm.graph.nodes]


def canonical_nodes(gm: torch.fx.GraphModule) -> list:
    """graph_nodes without names: each argument named by its node's position, placeholders by
    position, and each value's storage by the order storages first appear (so tensors sharing a
    storage in one graph must share it in the other: what the cost model's memory reads). For
    graphs made apart from a trace (aot/plan/repeated_blocks.py), whose node names differ."""
    from aot.capture.graph_reading import storage_key

    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    storages: dict = {}

    def arg(v):
        if isinstance(v, torch.fx.Node):
            return ("node", position[v])
        if isinstance(v, (list, tuple)):
            return [arg(x) for x in v]
        if isinstance(v, dict):
            return {k: arg(x) for k, x in v.items()}
        return repr(v)

    def meta(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, storages.setdefault(storage_key(v), len(storages))
        if isinstance(v, (list, tuple)):
            return [meta(x) for x in v]
        return "script object" if isinstance(v, torch.ScriptObject) else repr(v)

    return [(n.op, "placeholder" if n.op == "placeholder" else str(n.target), arg(n.args), arg(n.kwargs), meta(n.meta.get("val"))) for n in gm.graph.nodes]
