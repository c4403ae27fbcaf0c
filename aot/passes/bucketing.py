"""Gradient bucketing: many small all_reduces become a few large ones.

Capture emits one all_reduce per gradient. Each costs a fixed latency, so, as DDP does, gradients
are packed into buckets of about `bucket_bytes` in the order they are produced by backward,
reduced as one flat tensor and unpacked. Collectives per step then count buckets, not parameters.
Only all_reduces over the same group, op and dtype share a bucket, and only when all their
inputs exist before any of their results is needed (else the bucket would wait for itself).
"""

from __future__ import annotations

import operator

import torch

from aot.passes.graph_utils import ALL_REDUCE, PER_PROGRAM_GROUPS, WAIT, funcol, is_call, lint, stable_topological_sort, tensor_bytes

aten = torch.ops.aten


def _reducible(node: torch.fx.Node) -> bool:
    users = list(node.users)
    return is_call(node, {ALL_REDUCE}) and len(users) == 1 and is_call(users[0], {WAIT}) and node.args[2] not in PER_PROGRAM_GROUPS


def _reduced(member: torch.fx.Node) -> torch.fx.Node:
    x = member.args[0]
    assert isinstance(x, torch.fx.Node), member.format_node()  # an all_reduce reduces a graph value
    return x


def _contiguous(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    if x.meta["val"].is_contiguous():
        return x
    copy = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
    copy.meta["val"] = x.meta["val"].clone(memory_format=torch.contiguous_format)
    return copy


def _fuse(graph: torch.fx.Graph, members: list[torch.fx.Node], order: dict) -> None:
    """Replace the members by view -> cat -> all_reduce -> wait -> split -> view, placed right
    after the last member input (the overlap pass moves the wait later)."""
    inputs = [_reduced(m) for m in members]
    anchor = max(inputs, key=lambda n: order[n])
    op, group = members[0].args[1], members[0].args[2]
    with graph.inserting_after(anchor):
        # a gradient laid out transposed (a batched matmul's, the experts' under ep) is made
        # contiguous before it is flattened; the others are viewed as they are
        flats = [graph.call_function(aten.view.default, (_contiguous(graph, x), [-1])) for x in inputs]
    with graph.inserting_after(flats[-1]):
        packed = graph.call_function(aten.cat.default, (flats,))
    with graph.inserting_after(packed):
        reduced = graph.call_function(funcol.all_reduce.default, (packed, op, group))
    with graph.inserting_after(reduced):
        waited = graph.call_function(funcol.wait_tensor.default, (reduced,))
    sizes = [x.meta["val"].numel() for x in inputs]
    with graph.inserting_after(waited):
        parts = graph.call_function(aten.split_with_sizes.default, (waited, sizes))
    # Fake values as the step runs them, for the memory analysis (aot.plan.cost_model): the packed
    # bucket is a new buffer, the all_reduce's result another (functional collectives do not
    # write their input), and each member's result a view of that result, so a member's gradient
    # is free once packed while the bucket lives until its last member's result is read.
    for n, x in zip(flats, inputs):
        n.meta["val"] = x.meta["val"].reshape(-1)
    packed.meta["val"] = torch.cat([f.meta["val"] for f in flats])
    reduced.meta["val"] = waited.meta["val"] = torch.empty_like(packed.meta["val"])
    parts.meta["val"] = list(torch.split(waited.meta["val"], sizes))
    cursor = parts
    for i, (member, x) in enumerate(zip(members, inputs)):
        with graph.inserting_after(cursor):
            part = graph.call_function(operator.getitem, (parts, i))
        with graph.inserting_after(part):
            cursor = graph.call_function(aten.view.default, (part, list(x.meta["val"].shape)))
        part.meta["val"] = parts.meta["val"][i]
        cursor.meta["val"] = part.meta["val"].view(x.meta["val"].shape)
        wait = next(iter(member.users))
        wait.replace_all_uses_with(cursor)
        graph.erase_node(wait)
        graph.erase_node(member)


def bucket_all_reduces(gm: torch.fx.GraphModule, bucket_bytes: int) -> torch.fx.GraphModule:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    candidates = sorted((n for n in graph.nodes if _reducible(n)), key=lambda n: order[n.args[0]])
    # A bucket is reduced once all its inputs exist and must be done before any member's result
    # is used. Keeping (last input) < (first use) for each bucket, in the original order, keeps
    # every edge pointing forward in that order, so no bucket can end up waiting for itself.
    first_use = {n: min((order[u] for u in next(iter(n.users)).users), default=len(order)) for n in candidates}
    buckets: dict[tuple, list[list[torch.fx.Node]]] = {}
    for node in candidates:
        val = node.args[0].meta["val"]
        key = (node.args[1], node.args[2], val.dtype, val.device)
        open_buckets = buckets.setdefault(key, [[]])
        bucket = open_buckets[-1]
        size = sum(tensor_bytes(_reduced(m)) for m in bucket)
        ready = max(order[m.args[0]] for m in [*bucket, node])
        needed = min(first_use[m] for m in [*bucket, node])
        if bucket and (size >= bucket_bytes or ready >= needed):
            bucket = []
            open_buckets.append(bucket)
        bucket.append(node)
    for groups in buckets.values():
        for members in groups:
            if len(members) > 1:
                if any(_reduced(m) not in order for m in members):
                    # a gradient reduced over one group, then another (summed over tp, then averaged
                    # over ep or dp): its second all_reduce now reads the first bucket's result
                    order = {n: i for i, n in enumerate(graph.nodes)}
                _fuse(graph, members, order)
    stable_topological_sort(graph)
    lint(graph)
    gm.recompile()
    return gm
