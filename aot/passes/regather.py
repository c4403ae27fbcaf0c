"""FSDP re-gather: all-gather a parameter again for backward instead of keeping it from forward.

Autograd saves what backward needs, and for a layer that is its full (gathered) weight, so without
this pass every gathered parameter of the model stays alive from its forward use to its backward
use: at the turn of the step the rank holds the whole model, as data parallel would. FSDP (ZeRO-3)
frees each full parameter after forward and gathers it again when backward reaches its layer;
this pass does the same in the graph. Backward uses of a gathered parameter (and of views of it:
slices, reshapes, transposes) are redirected to a fresh gather of the same shard placed at that
point, so the forward copy dies after its last forward use. The gather is recomputed from the
unchanged shard (and, under mixed precision, cast from it again), so results are bit-identical; run before `prefetch_parameter_gathers`, which then
puts each backward gather one parameter ahead of its use too.
"""

from __future__ import annotations

import torch

from aot.capture.graph_reading import loss_node
from aot.passes.graph_utils import WAIT, fresh_value, is_call, lint, shard_gathers

_aten = torch.ops.aten
# Ops that only view their input: a chain of them from a gather still is "the parameter".
_VIEWS = {
    _aten.slice.Tensor,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.t.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.expand.default,
    _aten.alias.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.default,
}


def regather_in_backward(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = gm.graph
    boundary = loss_node(graph)
    if boundary is None:
        return gm
    position = {n: i for i, n in enumerate(graph.nodes)}
    turn = position[boundary]
    for gather, cast in shard_gathers(graph).items():
        waits = [u for u in gather.users if is_call(u, {WAIT})]
        if len(waits) != 1:
            continue
        chain = _view_chain(waits[0])
        late = [u for node in chain for u in node.users if u not in chain and position[u] > turn]
        if not late or all(position[node] > turn for node in chain):
            continue
        first = min(late, key=position.__getitem__)
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        with graph.inserting_before(first):
            for node in cast:  # mixed precision: the shard's cast to the gather dtype, recomputed too
                copies[node] = graph.node_copy(node)
            copies[gather] = graph.node_copy(gather, lambda n: copies.get(n, n))
            for node in chain:  # in graph order, so every input is copied before its users
                copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
        for copy in copies.values():
            fresh_value(copy)
        for node in chain:
            for user in [u for u in node.users if u not in chain and u not in copies.values() and position.get(u, -1) > turn]:
                user.replace_input_with(node, copies[node])
        for node in reversed(chain):  # views that only backward read are now dead: drop them
            if not node.users and node is not chain[0]:
                graph.erase_node(node)
    lint(graph)
    gm.recompile()
    return gm


def _view_chain(wait: torch.fx.Node) -> list[torch.fx.Node]:
    """The wait and every node that only views it (transitively), in graph order."""
    chain, todo = {wait}, [wait]
    while todo:
        for user in todo.pop().users:
            if user not in chain and is_call(user, _VIEWS) and user.args[0] in chain:
                chain.add(user)
                todo.append(user)
    return sorted(chain)  # nodes compare by their place in the graph
