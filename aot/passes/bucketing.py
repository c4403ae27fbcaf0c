"""Gradient bucketing: many small all_reduces become a few large ones.

Capture emits one all_reduce per gradient. Each costs a fixed latency, so, as DDP does, gradients
are packed into buckets of about `bucket_bytes` in the order they are produced by backward,
reduced as one flat tensor and unpacked. Collectives per step then count buckets, not parameters.
Only all_reduces over the same group, op and dtype share a bucket, and never one whose input
depends on another member's result (that would make the bucket wait for itself).
"""

from __future__ import annotations

import operator

import torch

from aot.passes.graph_utils import ALL_REDUCE, WAIT, funcol, is_call, stable_topological_sort, tensor_bytes

aten = torch.ops.aten


def _reducible(node: torch.fx.Node) -> bool:
    users = list(node.users)
    return is_call(node, {ALL_REDUCE}) and len(users) == 1 and is_call(users[0], {WAIT})


def _depends_on(node: torch.fx.Node, targets: set, memo: dict) -> bool:
    """Whether `node` is (transitively) computed from any node in `targets`."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen:
            continue
        seen.add(n)
        if memo.get(n) is False:
            continue
        stack.extend(n.all_input_nodes)
    memo[node] = False
    return False


def _fuse(graph: torch.fx.Graph, members: list[torch.fx.Node], order: dict) -> None:
    """Replace the members by view -> cat -> all_reduce -> wait -> split -> view, placed right
    after the last member input (the overlap pass moves the wait later)."""
    inputs = [m.args[0] for m in members]
    anchor = max(inputs, key=lambda n: order[n])
    op, group = members[0].args[1], members[0].args[2]
    with graph.inserting_after(anchor):
        flats = [graph.call_function(aten.view.default, (x, [-1])) for x in inputs]
    with graph.inserting_after(flats[-1]):
        packed = graph.call_function(aten.cat.default, (flats,))
    with graph.inserting_after(packed):
        reduced = graph.call_function(funcol.all_reduce.default, (packed, op, group))
    with graph.inserting_after(reduced):
        waited = graph.call_function(funcol.wait_tensor.default, (reduced,))
    sizes = [x.meta["val"].numel() for x in inputs]
    with graph.inserting_after(waited):
        parts = graph.call_function(aten.split_with_sizes.default, (waited, sizes))
    cursor = parts
    for i, (member, x) in enumerate(zip(members, inputs)):
        with graph.inserting_after(cursor):
            part = graph.call_function(operator.getitem, (parts, i))
        with graph.inserting_after(part):
            cursor = graph.call_function(aten.view.default, (part, list(x.meta["val"].shape)))
        cursor.meta["val"] = x.meta["val"]
        wait = next(iter(member.users))
        wait.replace_all_uses_with(cursor)
        graph.erase_node(wait)
        graph.erase_node(member)
    for n, x in zip(flats, inputs):
        n.meta["val"] = x.meta["val"].reshape(-1)
    packed.meta["val"] = torch.cat([f.meta["val"] for f in flats])
    reduced.meta["val"] = waited.meta["val"] = packed.meta["val"]


def bucket_all_reduces(gm: torch.fx.GraphModule, bucket_bytes: int) -> torch.fx.GraphModule:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    candidates = sorted((n for n in graph.nodes if _reducible(n)), key=lambda n: order[n.args[0]])
    buckets: dict[tuple, list[list[torch.fx.Node]]] = {}
    for node in candidates:
        val = node.args[0].meta["val"]
        key = (node.args[1], node.args[2], val.dtype, val.device)
        open_buckets = buckets.setdefault(key, [[]])
        bucket = open_buckets[-1]
        size = sum(tensor_bytes(m.args[0]) for m in bucket)
        waits = {next(iter(m.users)) for m in bucket}
        if bucket and (size >= bucket_bytes or _depends_on(node.args[0], waits, {})):
            bucket = []
            open_buckets.append(bucket)
        bucket.append(node)
    for groups in buckets.values():
        for members in groups:
            if len(members) > 1:
                _fuse(graph, members, order)
    stable_topological_sort(graph)
    graph.lint()
    gm.recompile()
    return gm
