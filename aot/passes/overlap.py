"""Overlap of communication with computation: issue collectives early, wait for them late.

Functional collectives run asynchronously between the collective op and its wait_tensor. This
pass moves each collective (with the packing ops that only feed it) right after the last of its
inputs is computed, and each wait right before the first use of its result, so gradient buckets
travel while backward computes the next ones. Every rank runs the same program, so every rank
issues the collectives in the same order and no rank-dependent order can deadlock.
"""

from __future__ import annotations

import operator

import torch

from aot.passes.graph_utils import COLLECTIVES, WAIT, first_user, is_call, latest_input, lint, place_after

aten = torch.ops.aten
# Ops that only reshape, pack, pad or cast a tensor for a collective: free to move with it. The
# padding (slice_backward: a gradient into FSDP's flat-padded layout) and the cast to the reduce
# dtype matter most: autograd runs FSDP's gradient reduce-scatters last (their gathers were made
# first), so without moving these every layer's full gradient lived until the end of backward.
_PACKING = {
    aten.view.default,
    aten.cat.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.slice_backward.default,
    aten.constant_pad_nd.default,
    aten._to_copy.default,
}
# Ops that only unpack a collective's result: they move down with its wait.
_UNPACKING = {aten.view.default, aten.split_with_sizes.default, aten._unsafe_view.default, operator.getitem, aten.slice.Tensor}


def _hoist(node: torch.fx.Node, last_placeholder: torch.fx.Node | None, fence: torch.fx.Node | None = None) -> None:
    for inp in node.all_input_nodes:
        if is_call(inp, _PACKING) and len(inp.users) == 1:
            _hoist(inp, last_placeholder)
    anchor = max((n for n in (latest_input(node), fence) if n is not None), default=None)
    if anchor is not None:
        place_after(anchor, node, last_placeholder)


def _p2p_fences(nodes: list) -> dict:
    """collective -> the last point-to-point transfer (a pipeline's isend or irecv) on its group
    before it. A collective never moves above one: a process group runs its operations in the
    order each rank issues them, and the pipeline ranks' programs differ (a collective whose
    input is a constant on one rank would be issued there before transfers another rank issues
    first: a deadlock)."""
    last: dict = {}
    fences: dict = {}
    for node in nodes:
        name = getattr(getattr(node.target, "_schema", None), "name", "") if node.op == "call_function" else ""
        if name.split("::")[-1] in ("isend", "irecv"):
            last[node.args[-1]] = node
        elif is_call(node, COLLECTIVES):
            fences[node] = last.get(node.args[-1])
    return fences


def _sink(node: torch.fx.Node) -> None:
    for user in list(node.users):
        if is_call(user, _UNPACKING):
            _sink(user)
    first = first_user(node)
    if first is not None and first.prev is not node:
        first.prepend(node)


def issue_early_wait_late(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    nodes = list(gm.graph.nodes)
    last_placeholder = next((n for n in reversed(nodes) if n.op == "placeholder"), None)
    fences = _p2p_fences(nodes)
    for node in nodes:
        if is_call(node, COLLECTIVES):
            _hoist(node, last_placeholder, fences[node])
    for node in reversed(nodes):
        if is_call(node, {WAIT}):
            _sink(node)
    lint(gm.graph)
    gm.recompile()
    return gm
