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
