"""Small helpers the graph passes share: recognizing collectives and moving nodes safely."""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch._subclasses.fake_tensor import FakeTensor

from runner.format.axes import PP, group_name

funcol = torch.ops._c10d_functional
ALL_REDUCE = funcol.all_reduce.default
ALL_GATHER = funcol.all_gather_into_tensor.default
WAIT = funcol.wait_tensor.default
# Groups whose members run different programs (pipeline stages): a pass sees one program only,
# so it must not regroup their collectives, which every member has to issue alike.
PER_PROGRAM_GROUPS = (group_name(PP),)
COLLECTIVES = {
    ALL_REDUCE,
    ALL_GATHER,
    funcol.reduce_scatter_tensor.default,
    funcol.broadcast.default,
    funcol.all_to_all_single.default,  # expert parallelism's token dispatch (aot/capture/expert_parallel.py)
}


# set inside lint_once: while run_passes (or the memory-budget search around it) runs a sequence
# of passes, which lints the graph once after the last
_LINT_DEFERRED = contextvars.ContextVar("lint_deferred", default=False)


def lint(graph: torch.fx.Graph) -> None:
    """A pass's check of the graph it leaves (graph.lint()), made once after the whole sequence
    where `lint_once` runs one: a fifth of a second per pass on a 60-layer step, run for every
    point the memory-budget search and the planner try."""
    if not _LINT_DEFERRED.get():
        graph.lint()


@contextlib.contextmanager
def lint_once():
    """Passes run inside skip their own lint; the caller lints the graph it ends with."""
    token = _LINT_DEFERRED.set(True)
    try:
        yield
    finally:
        _LINT_DEFERRED.reset(token)


def is_call(node: torch.fx.Node, targets) -> bool:
    return node.op == "call_function" and node.target in targets


def shard_gathers(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """FSDP's parameter gathers: all_gathers of a graph input (a parameter's shard) or of its cast
    to the compute dtype (mixed precision, FSDP's param_dtype), each with the cast it needs, if
    any ([] or [cast]), which moves and is recomputed with it."""
    found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if not is_call(node, {ALL_GATHER}):
            continue
        source = node.args[0]
        if source.op == "placeholder":
            found[node] = []
        elif is_call(source, {torch.ops.aten._to_copy.default}) and source.args[0].op == "placeholder" and len(source.users) == 1:
            found[node] = [source]
    return found


def fresh_value(node: torch.fx.Node) -> None:
    """node_copy shares the original's fake value, hence its storage: give the copy a value of its
    own so later analyses (memory liveness) see a new buffer and views of it. An op that returns
    new tensors (no output aliases an input) gets the original's shapes in new storages; any other
    is run again on fake tensors from the copy's own inputs (a view must view the copy's input)."""
    val = node.meta.get("val")
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        for t in val if isinstance(val, (tuple, list)) else ():
            mode = getattr(t, "fake_mode", None) or mode
    if mode is None:
        return
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.returns and all(r.alias_info is None for r in schema.returns):
        # a tenth of the cost of the op's fake dispatch, for the tens of thousands of copies the
        # planner's passes make of a deep model's step
        node.meta["val"] = _in_new_storages(val, mode)
        return
    base = _viewed_input(node, schema)
    if base is not None and isinstance(val, FakeTensor):
        # a view of the copy's input, which is laid out as the original's: the original view's
        # shape, strides and offset in the input's storage, as cheaply
        node.meta["val"] = fake_in_storage(val, base.untyped_storage(), mode)
        return
    as_value = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a
    # the passes copy only call_function nodes (aten ops), whose target is the op to call
    assert callable(node.target), node.format_node()
    with mode:
        node.meta["val"] = node.target(*torch.fx.node.map_aggregate(node.args, as_value), **torch.fx.node.map_aggregate(node.kwargs, as_value))


def _viewed_input(node: torch.fx.Node, schema) -> torch.Tensor | None:
    """The value of the argument a one-output view op returns a view of (`Tensor(a) self` of
    `view`, `slice`, `t`); None for any other op or where that argument is not a node's tensor."""
    if schema is None or len(schema.returns) != 1 or schema.returns[0].alias_info is None or schema.returns[0].alias_info.is_write:
        return None
    sets = schema.returns[0].alias_info.before_set
    for argument, value in zip(schema.arguments, node.args):
        if argument.alias_info is not None and argument.alias_info.before_set == sets and isinstance(value, torch.fx.Node):
            base = value.meta.get("val")
            return base if isinstance(base, FakeTensor) else None
    return None


def _in_new_storages(val, mode):
    """`val` (a fake tensor, or lists and tuples of them) with each tensor in a new storage."""
    if isinstance(val, (list, tuple)):
        return type(val)(_in_new_storages(v, mode) for v in val)
    if not isinstance(val, FakeTensor):
        return val
    return fake_in_storage(val, torch.empty(val.untyped_storage().nbytes(), dtype=torch.uint8, device="meta").untyped_storage(), mode)


def fake_in_storage(like: torch.Tensor, storage, mode) -> torch.Tensor:
    """A fake tensor of `like`'s shape, strides, offset and dtype in `storage` (a meta storage),
    made without dispatching through the fake mode: some 15 us, a tenth of an op's fake dispatch."""
    elem = torch.empty(0, dtype=like.dtype, device="meta").set_(storage, like.storage_offset(), like.shape, like.stride())
    return FakeTensor(mode, elem, like.device)


def copy_graph(gm: torch.fx.GraphModule, node_map: dict | None = None) -> torch.fx.GraphModule:
    """A copy of the graph whose nodes share their fake values with the original's (the passes
    give new nodes new values and never change an existing one's), so storage identities, and
    the aliases keyed by them, hold in both: a deepcopy of a large step's fake tensors would also
    cost more than all the passes. `node_map`, where given, is filled with each node's copy."""
    from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, node_map if node_map is not None else {}))
    # a lazy module's copy is lazy too (the planner's: aot.plan.pricing.trace_for_pricing), so
    # neither it nor the passes' recompile() after each change writes Python code no one runs
    # (a fifth of planning Llama 8B's step at 128 nodes)
    with _use_lazy_graph_module(isinstance(gm, _LazyGraphModule)):
        return _make_graph_module(gm, graph)


def tensors(value) -> list[torch.Tensor]:
    """The tensors in a value (a tensor, or nested lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in tensors(v)] if isinstance(value, (list, tuple)) else []


def is_view(target) -> bool:
    """Whether an operator returns views of its inputs only (its schema aliases every return, none written)."""
    schema = getattr(target, "_schema", None)
    returns = schema.returns if schema is not None else ()
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def tensor_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def latest_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of `node` that comes last in graph order (None if it has none). Nodes compare by
    their place in the graph (torch keeps a sort key per node as nodes move): a walk back from
    `node` cost the overlap pass a third of planning Llama 8B."""
    return max((i for i in node.all_input_nodes if i < node), default=None)


def first_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return min((u for u in node.users if u > node), default=None)


def place_after(anchor: torch.fx.Node, node: torch.fx.Node, last_placeholder: torch.fx.Node | None = None) -> None:
    """Move `node` right after `anchor`, but never among the graph's placeholders (`last_placeholder`:
    the graph's last one, where the caller knows it; a walk over thousands of parameters per call
    otherwise)."""
    if anchor.op == "placeholder":
        if last_placeholder is not None:
            anchor = last_placeholder
        while anchor.next.op == "placeholder":
            anchor = anchor.next
    if anchor is not node and anchor.next is not node:
        anchor.append(node)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder nodes so each follows its inputs, keeping the existing order where it is legal: a
    node whose inputs are not all placed yet waits for the last of them, then goes right after the
    node that freed it. (torch has this function in torch._inductor.pattern_matcher, whose import
    costs every build about a second of CPU for nothing else.)"""
    placed: set[torch.fx.Node] = set()
    waiting: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    pending = list(reversed(graph.nodes))
    cursor = None
    while pending:
        node = pending.pop()
        inputs: list[torch.fx.Node] = []
        torch.fx.map_arg((node.args, node.kwargs), inputs.append)
        missing = [x for x in inputs if x not in placed]
        if missing:
            waiting.setdefault(missing[-1], []).append(node)
            continue
        placed.add(node)
        if cursor is not None and cursor.next is not node:
            cursor.append(node)
        cursor = node
        pending.extend(reversed(waiting.pop(node, ())))
    if waiting or len(placed) != len(graph.nodes):
        raise ValueError("stable_topological_sort: the graph has a cycle")
