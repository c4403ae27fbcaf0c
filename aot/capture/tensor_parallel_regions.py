"""Tensor parallelism in a replayed forward graph: its collectives made differentiable again.

A pipeline stage replays the cut forward graph under autograd (aot/capture/pipeline.py). DTensor's
backward collectives live in its autograd functions, which a graph of aten ops no longer has: a
column-wise layer's input needs its gradient all-reduced over tp (the slices of the input gradient
are partial sums), and the all_reduce after a row-wise layer passes its gradient through
unchanged. These are Megatron's "copy to" and "reduce from" the tensor-parallel region;
`differentiable_regions` puts them back into the graph as calls of the two functions below, whose
collectives the stage's trace records as graph nodes.
"""

from __future__ import annotations

import torch

from runner.sharding import tp_style

_funcol = torch.ops._c10d_functional


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _funcol.wait_tensor(_funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _funcol.wait_tensor(_funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: str) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: str) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


def differentiable_regions(graph: torch.fx.GraphModule, plan: dict[str, str], group: str, params: set, split: set) -> None:
    """`params`: the placeholders of parameters, `split` those tp splits. A value made from split
    parameters alone (a weight slice's view or transpose) is the rank's own: no all_reduce. One
    made from whole parameters only and read inside a row-wise layer (its bias, which DTensor
    divides by the tp degree so the layer's all_reduce adds it once) gets a partial gradient on
    each rank: summed, as DTensor's Replicate -> Partial redistribution sums it."""
    g = graph.graph
    copies: dict = {}
    derived = {p: {p} for p in params}  # parameter-only values -> the parameter placeholders they come from
    for node in g.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(a in derived for a in node.all_input_nodes):
            derived[node] = set().union(*(derived[a] for a in node.all_input_nodes))
    for node in list(g.nodes):
        calls = {name for name, _ in node.meta.get("custom", {}).get("aot_module_calls", ())}
        styles = {tp_style(plan[c])[0] for c in calls if c in plan}  # "colwise:K" is column-wise
        if node.op != "call_function" or not styles:
            continue
        for a in node.all_input_nodes:
            inside = {name for name, _ in a.meta.get("custom", {}).get("aot_module_calls", ())}
            val = a.meta.get("val")
            if calls & inside & set(plan) or not isinstance(val, torch.Tensor) or not val.is_floating_point():
                continue
            if a in derived:  # a weight: only a whole one read by a row-wise layer needs the sum
                if "rowwise" not in styles or derived[a] & split:
                    continue
            elif a.op == "placeholder" or "colwise" not in styles:
                continue
            if a not in copies:
                with g.inserting_after(a):
                    copies[a] = g.call_function(copy_to_tensor_parallel, (a, group))
                copies[a].meta.update(val=val, custom=dict(a.meta.get("custom", {})))
            node.replace_input_with(a, copies[a])
    for node in list(g.nodes):
        if node.op == "call_function" and node.target is _funcol.all_reduce.default and node.args[2] == group:
            waits = [u for u in node.users if u.target is _funcol.wait_tensor.default]
            with g.inserting_before(node):
                reduced = g.call_function(reduce_from_tensor_parallel, (node.args[0], group))
            reduced.meta.update(node.meta)
            for w in waits:
                w.replace_all_uses_with(reduced)
                g.erase_node(w)
            g.erase_node(node)
    g.lint()
    graph.recompile()
