"""How large a token id the step can take: read from the captured graph, so the runner can refuse a
data token at or above the model's vocabulary in one line (naming the shard and offset) instead of
an index error inside a step, or, on a GPU, a device-side assert.

An integer input that reaches `aten.embedding` through views and copies only is bounded by the
embedding's rows; targets that reach `nll_loss` (cross-entropy's core) by the logits' classes. An
input that reaches neither (a vocabulary-parallel embedding's shifted ids, a model's own lookup)
gets no bound, and its data is not checked.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
# ops that pass the ids through unchanged in value
_PASS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.flatten.using_ints,
    aten.clone.default,
    aten.expand.default,
    aten._to_copy.default,
    aten.alias.default,
    aten.permute.default,
    aten.t.default,
    aten.contiguous.default,
}
_LOSSES = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}


def _value(arg) -> torch.Tensor:
    assert isinstance(arg, torch.fx.Node)  # an op's tensor argument
    return arg.meta["val"]


def _bound(placeholder: torch.fx.Node) -> int | None:
    """The smallest bound any consumer of `placeholder`'s values sets, or None."""
    bounds, seen, todo = [], set(), [placeholder]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user.target in _PASS and user.args and user.args[0] is node:
                todo.append(user)
            elif user.target == aten.embedding.default and len(user.args) > 1 and user.args[1] is node:
                bounds.append(_value(user.args[0]).shape[0])
            elif user.target in _LOSSES and len(user.args) > 1 and user.args[1] is node:
                logits = _value(user.args[0])
                bounds.append(logits.shape[1 if logits.dim() > 1 else 0])
    return min(bounds) if bounds else None


def token_bounds(graphs: list[torch.fx.GraphModule], slots_of: list[list[dict]]) -> dict[str, int]:
    """{"inputs.I" | "targets": the least id no token may reach} over the programs' graphs (a
    pipeline's stages: the first holds the embedding, the last the loss)."""
    found: dict[str, int] = {}
    for gm, slots in zip(graphs, slots_of):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, slot in zip(placeholders, slots):
            if slot["kind"] not in ("input", "target") or not slot["dtype"].startswith(("int", "uint")):
                continue
            bound = _bound(node)
            key = "targets" if slot["kind"] == "target" else f"inputs.{slot['index']}"
            if bound is not None:
                found[key] = min(bound, found.get(key, bound))
    return found
