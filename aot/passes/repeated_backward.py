"""Graph pass: a backward differentiated twice computes the shared gradients once.

Zero-bubble pipelines split a stage's backward in two (aot/capture/pipeline.py): the gradient of
its inputs first, then, later, of its weights. Each is a `torch.autograd.grad` over the same
autograd graph, and the second records again every activation gradient on the way to the weights
(a linear layer's weight gradient needs the gradient of its output, which the first pass already
computed). Nodes recorded by the second pass are tagged (node.meta["custom"][WEIGHT_GRADIENT],
set by aot/capture/pipeline.py);
each tagged node that repeats an earlier node (same operator, same arguments) is replaced by it,
so the second pass keeps only the weight-gradient ops and reads the first pass's results.

Backward operators that compute several gradients at once take an `output_mask` saying which
(`native_layer_norm_backward`: of the input, the weight, the bias): the first pass asks for the
input's, the second for all three. Such a tagged node reads the outputs the earlier node computed
from it (their users are moved there) and stops computing them (its mask cleared there).

Only what is safe to share is merged: operators that write none of their arguments, draw no
random numbers and communicate nothing, whose results (and views of them) nothing writes to later.
"""

from __future__ import annotations

import operator

import torch

from aot.capture.pipeline import WEIGHT_GRADIENT
from aot.capture.graph_reading import written_values
from aot.passes.graph_utils import is_view, lint

_NO_SHARING = ("_c10d_functional", "c10d", "_dtensor")


def _tagged(node: torch.fx.Node) -> bool:
    return bool(node.meta.get("custom", {}).get(WEIGHT_GRADIENT))


def _written_later(node: torch.fx.Node) -> bool:
    """Whether an op writes `node`'s result, or a view of it, in place."""
    for user in node.users:
        written = written_values(user)
        if any(v is node or (isinstance(v, (list, tuple)) and any(w is node for w in v)) for v in written):
            return True
        if user.op == "call_function" and (user.target is operator.getitem or is_view(user.target)) and _written_later(user):
            return True
    return False


def _shareable(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in _NO_SHARING:
        return False
    if written_values(node) or torch.Tag.nondeterministic_seeded in target.tags:  # an entry per written argument
        return False
    return not target.__name__.startswith(("empty", "new_empty"))  # uninitialized memory is filled by whoever holds it


def _frozen(value):
    """A hashable form of an argument (lists as tuples); nodes stand for themselves."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, float) and value != value:  # NaN never equals itself
        return ("nan",)
    return value


def _mask_position(node: torch.fx.Node) -> int | None:
    """Where an operator's `output_mask` (which of its outputs it computes) is among its arguments."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    i = names.index("output_mask") if "output_mask" in names else None
    return i if i is not None and i < len(node.args) and isinstance(node.args[i], (list, tuple)) else None


def _output(node: torch.fx.Node, index: int) -> torch.fx.Node:
    """`node`'s getitem of output `index`, made after it where none exists."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    with node.graph.inserting_after(node):
        item = node.graph.call_function(operator.getitem, (node, index))
    item.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    if isinstance(node.meta.get("val"), (list, tuple)):
        item.meta["val"] = node.meta["val"][index]
    return item


def _share_outputs(node: torch.fx.Node, earlier: torch.fx.Node, at: int, gone: set) -> bool:
    """Point the users of `node`'s outputs that `earlier` computed too at `earlier`'s, and clear
    them from `node`'s mask; True where `node` then computes nothing and is gone. Erased nodes
    join `gone`."""
    mine, theirs = list(node.args[at]), list(earlier.args[at])  # type: ignore[arg-type]  # _mask_position found lists there
    for user in list(node.users):
        index = user.args[1] if user.target is operator.getitem else None
        if isinstance(index, int) and theirs[index]:
            user.replace_all_uses_with(_output(earlier, index))
            mine[index] = False
            node.graph.erase_node(user)
            gone.add(user)
    if not any(mine) or not node.users:
        node.graph.erase_node(node)
        gone.add(node)
        return True
    node.args = (*node.args[:at], mine, *node.args[at + 1 :])
    return False


def _key(node: torch.fx.Node, masked: int | None = None):
    """What makes two calls compute the same: operator and arguments (the mask left out at
    `masked`); None where an argument cannot be compared."""
    args = node.args if masked is None else (*node.args[:masked], None, *node.args[masked + 1 :])
    try:
        key = (node.target, _frozen(args), _frozen(node.kwargs))
        hash(key)
    except TypeError:
        return None
    return key


def merge_repeated_backward(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with every tagged node that repeats an earlier node replaced by that node (in place);
    a graph without tagged nodes (every schedule but zero-bubble) is returned as it is."""
    graph = gm.graph
    if not any(_tagged(node) for node in graph.nodes):
        return gm
    first: dict = {}
    gone: set = set()
    merged = 0
    for node in list(graph.nodes):
        if node in gone or not _shareable(node):
            continue
        at = _mask_position(node)
        key = _key(node, at)
        if key is None:
            continue
        earlier = first.get(key)
        if earlier is None:
            first[key] = node
            continue
        if not _tagged(node) or _written_later(node) or _written_later(earlier):
            continue
        if at is None:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            merged += 1
        elif _share_outputs(node, earlier, at, gone):
            merged += 1
    if merged:
        graph.eliminate_dead_code()
        lint(graph)
        gm.recompile()
    return gm
