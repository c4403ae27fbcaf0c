"""Hierarchical all_reduce: reduce inside each node first, cross the network with a fraction.

A group that spans N nodes with g of its ranks on each can all_reduce n bytes in three steps:
reduce-scatter over the g ranks of a node (each keeps n/g reduced bytes), all_reduce those n/g bytes
across the N nodes among the ranks that hold the same piece, then all-gather the pieces inside the
node. Only n/g bytes per rank cross the network and the latency-bound steps are N- and g-wide instead
of Ng-wide. This pass rewrites the all_reduces the planner chose for it (`choose(group, nbytes)`
returns the two sub-groups, else None) into exactly those three functional collectives over the
sub-groups ("aot.dp.intra", "aot.dp.inter"), so later passes can move them like any other and the
runner binds the sub-groups the manifest lists like any other group.

The buffer is flattened and zero-padded to a multiple of g (reduce-scatter splits evenly), and the
result is cut back and reshaped. Any reduce op that commutes with the split works the same way:
sum, and avg (an average of equal-sized averages is the average).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aot.passes.graph_utils import ALL_GATHER, ALL_REDUCE, WAIT, funcol, is_call, lint

aten = torch.ops.aten
REDUCE_SCATTER = funcol.reduce_scatter_tensor.default


@dataclass(frozen=True)
class SubGroups:
    """The graph names of the two levels of one group, and the size of the node level (the
    network level's size is the manifest's business: the pass only pads to a multiple of g)."""

    intra: str
    intra_size: int  # g: the group's ranks on one node
    inter: str


def _with_val(node: torch.fx.Node, val) -> torch.fx.Node:
    node.meta["val"] = val
    return node


def _split(graph: torch.fx.Graph, reduce: torch.fx.Node, wait: torch.fx.Node, levels: SubGroups) -> None:
    x, op = reduce.args[0], reduce.args[1]
    assert isinstance(x, torch.fx.Node), reduce.format_node()  # an all_reduce reduces a graph value
    val = x.meta["val"]
    numel, g = val.numel(), levels.intra_size
    padded = -(-numel // g) * g
    piece = val.new_empty((padded // g,))
    # The buffer flattened and padded, and the reduce-scatter, the all_reduce across nodes and the
    # all-gather issued, right where the buffer is made, each of the first two waited for before the
    # next takes its result: the all_reduce's start, wherever the overlap pass would have issued it.
    # Only the all-gather's wait and the cut back to shape stay where the all_reduce was waited for.
    # (The overlap pass moves collectives and waits, not ops: a chain left at the all_reduce's place
    # started where the step had put it, late for a value made early such as the loss.)
    cursor = x if x.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]  # ops follow every input

    def after(node: torch.fx.Node) -> torch.fx.Node:
        nonlocal cursor
        cursor.append(node)
        cursor = node
        return node

    flat = after(_with_val(graph.call_function(aten.view.default, (x, [-1])), val.reshape(-1)))
    if padded != numel:
        flat = after(_with_val(graph.call_function(aten.constant_pad_nd.default, (flat, [0, padded - numel])), val.new_empty((padded,))))
    scattered = after(_with_val(graph.call_function(REDUCE_SCATTER, (flat, op, g, levels.intra)), piece))
    scattered_done = after(_with_val(graph.call_function(WAIT, (scattered,)), piece))
    across = after(_with_val(graph.call_function(ALL_REDUCE, (scattered_done, op, levels.inter)), piece))
    across_done = after(_with_val(graph.call_function(WAIT, (across,)), piece))
    gathered = after(_with_val(graph.call_function(ALL_GATHER, (across_done, g, levels.intra)), val.new_empty((padded,))))
    with graph.inserting_before(reduce):
        out = _with_val(graph.call_function(WAIT, (gathered,)), val.new_empty((padded,)))
        if padded != numel:
            out = _with_val(graph.call_function(aten.slice.Tensor, (out, 0, 0, numel)), val.reshape(-1))
        out = _with_val(graph.call_function(aten.view.default, (out, list(val.shape))), val)
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)
    graph.erase_node(reduce)


def split_hierarchical(gm: torch.fx.GraphModule, choose: Callable[[str, int], SubGroups | None] | None) -> torch.fx.GraphModule:
    """Rewrite each all_reduce for which `choose(group name, bytes)` names sub-groups."""
    if choose is None:
        return gm
    graph = gm.graph
    changed = False
    for reduce in [n for n in graph.nodes if is_call(n, {ALL_REDUCE})]:
        waits = [u for u in reduce.users if is_call(u, {WAIT})]
        if len(waits) != 1 or len(reduce.users) != 1:
            continue
        val = reduce.args[0].meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        levels = choose(str(reduce.args[2]), val.numel() * val.element_size())
        if levels is not None:
            _split(graph, reduce, waits[0], levels)
            changed = True
    if changed:
        lint(graph)
        gm.recompile()
    return gm
