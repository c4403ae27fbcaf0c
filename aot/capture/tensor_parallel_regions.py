"""Tensor parallelism in a replayed forward graph: its collectives made differentiable again.

A pipeline stage replays the cut forward graph under autograd (aot/capture/pipeline.py). DTensor's
backward collectives live in its autograd functions, which a graph of aten ops no longer has: a
column-wise layer's input needs its gradient all-reduced over tp (the slices of the input gradient
are partial sums), and the all_reduce after a row-wise layer passes its gradient through
unchanged. These are Megatron's "copy to" and "reduce from" the tensor-parallel region;
`differentiable_regions` puts them back into the graph as calls of the functions below, whose
collectives the stage's trace records as graph nodes.

With sequence parallelism the residual stream between blocks holds each rank's slice of the
sequence: a region's input is all-gathered (its gradient reduce-scattered: the column-wise layers'
input gradients are partial sums), a row-wise output reduce-scattered (its gradient all-gathered),
and a norm's whole weight, which sees only this rank's tokens, gets a partial gradient, summed
over tp as DTensor's Replicate -> Partial redistribution sums it. Megatron's "gather from" and
"reduce-scatter to" the sequence-parallel region.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.format.sharding import tp_style

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


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, size, group):
        ctx.size, ctx.group = size, group
        return _funcol.wait_tensor(_funcol.all_gather_into_tensor(x, size, group))

    @staticmethod
    def backward(ctx, grad):
        return _funcol.wait_tensor(_funcol.reduce_scatter_tensor(grad.contiguous(), "sum", ctx.size, ctx.group)), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, size, group):
        ctx.size, ctx.group = size, group
        return _funcol.wait_tensor(_funcol.reduce_scatter_tensor(x, op, size, group))

    @staticmethod
    def backward(ctx, grad):
        return _funcol.wait_tensor(_funcol.all_gather_into_tensor(grad.contiguous(), ctx.size, ctx.group)), None, None, None


def gather_from_sequence_parallel(x: torch.Tensor, size: int, group: str) -> torch.Tensor:
    return _GatherFromSequenceParallel.apply(x, size, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, op: str, size: int, group: str) -> torch.Tensor:
    return _ReduceScatterToSequenceParallel.apply(x, op, size, group)


def copy_to_tensor_parallel(x: torch.Tensor, group: str) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: str) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


def differentiable_regions(graph: torch.fx.GraphModule, plan: dict[str, str], group: str, params: set, split: set, sequence: dict | None = None) -> None:
    """`params`: the placeholders of parameters, `split` those tp splits. A value made from split
    parameters alone (a weight slice's view or transpose) is the rank's own: no all_reduce. One
    made from whole parameters only and read inside a row-wise layer (its bias, which DTensor
    divides by the tp degree so the layer's all_reduce adds it once), or by a norm on the
    sequence-split stream (sequence parallelism: `sequence`, the build's layout), gets a partial
    gradient on each rank: summed, as DTensor's Replicate -> Partial redistribution sums it. Under
    sequence parallelism a column-wise layer's input is the region's gathered input, whose
    gradient the gather's backward already reduce-scatters: no all_reduce there."""
    norms = set(sequence["norms"]) if sequence is not None else set()
    g = graph.graph
    copies: dict = {}
    derived = {p: {p} for p in params}  # parameter-only values -> the parameter placeholders they come from
    for node in g.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(a in derived for a in node.all_input_nodes):
            derived[node] = set().union(*(derived[a] for a in node.all_input_nodes))
    sequence_collectives = (_funcol.all_gather_into_tensor.default, _funcol.reduce_scatter_tensor.default)
    for node in list(g.nodes):
        calls = {name for name, _ in node.meta.get("custom", {}).get("aot_module_calls", ())}
        if node.op == "call_function" and calls & norms and node.target not in sequence_collectives:
            for a in node.all_input_nodes:
                if a in derived and not derived[a] & split and a not in copies:  # a norm's whole weight
                    with g.inserting_after(a):
                        copies[a] = g.call_function(copy_to_tensor_parallel, (a, group))
                    copies[a].meta.update(val=a.meta.get("val"), custom=dict(a.meta.get("custom", {})))
                if a in copies:
                    node.replace_input_with(a, copies[a])
            continue
        styles = {tp_style(plan[c])[0] for c in calls if c in plan}  # "colwise:K" is column-wise
        if node.op != "call_function" or not styles or node.target in sequence_collectives:
            continue  # a region's own gather / reduce-scatter: made differentiable below
        for a in node.all_input_nodes:
            inside = {name for name, _ in a.meta.get("custom", {}).get("aot_module_calls", ())}
            val = a.meta.get("val")
            if calls & inside & set(plan) or not isinstance(val, torch.Tensor) or not val.is_floating_point():
                continue
            if a in derived:  # a weight: only a whole one read by a row-wise layer needs the sum
                if "rowwise" not in styles or derived[a] & split:
                    continue
            elif a.op == "placeholder" or "colwise" not in styles or sequence is not None:
                continue
            if a not in copies:
                with g.inserting_after(a):
                    copies[a] = g.call_function(copy_to_tensor_parallel, (a, group))
                copies[a].meta.update(val=val, custom=dict(a.meta.get("custom", {})))
            node.replace_input_with(a, copies[a])
    for node in list(g.nodes):
        if node.op != "call_function" or group not in node.args:
            continue
        replacement: Callable[..., torch.Tensor]
        if node.target is _funcol.all_reduce.default:
            replacement, args = reduce_from_tensor_parallel, (node.args[0], group)
        elif sequence is None:  # only sequence parallelism's gathers feed tp-split work (partial gradients)
            continue
        elif node.target is _funcol.all_gather_into_tensor.default:
            replacement, args = gather_from_sequence_parallel, tuple(node.args)
        elif node.target is _funcol.reduce_scatter_tensor.default:
            replacement, args = reduce_scatter_to_sequence_parallel, tuple(node.args)
        else:
            continue
        waits = [u for u in node.users if u.target is _funcol.wait_tensor.default]
        with g.inserting_before(node):
            reduced = g.call_function(replacement, args)
        reduced.meta.update(node.meta)
        for w in waits:
            w.replace_all_uses_with(reduced)
            g.erase_node(w)
        g.erase_node(node)
    g.lint()
    graph.recompile()
