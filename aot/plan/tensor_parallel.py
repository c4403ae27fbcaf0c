"""Which Linear layers tensor parallelism shards, and how (Megatron-style pairs).

A column-wise layer (weight and bias split along the output features) is followed, through
operations that act on each feature, head or element separately, by a row-wise layer (weight split
along the input features): the activations between them stay sharded, and only the row-wise
layer's output needs an all-reduce. In attention that is q, k and v column-wise and the output
projection row-wise; in an MLP, the first layer column-wise and the second row-wise.

The plan is found from the forward graph (torch.export keeps `aten.linear` with the module each
call came from): starting at every Linear, follow its activations forward; if they reach only
other Linears' inputs, through operations from `_SHARD_LOCAL`, and meet no other activations than
those of Linears of the same group, the starting Linears are column-wise and the reached ones
row-wise. Everything else stays replicated. A model file's optional `tp_plan` (module name ->
"colwise" | "rowwise") replaces the found plan. Numbers never depend on the plan being good: torch's
DTensor propagation (aot.capture.step) derives the collectives from the placements, and a shard
shape the code cannot take fails the trace with one line.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from aot.errors import AotError

STYLES = ("colwise", "rowwise")
_HEAD_COUNT_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads")

_aten = torch.ops.aten
# Operations that compute each output element from the same position of their inputs (or move
# elements without mixing features), so they may run on a shard of the features as on the whole.
_SHARD_LOCAL = {
    _aten.add,
    _aten.sub,
    _aten.mul,
    _aten.div,
    _aten.neg,
    _aten.relu,
    _aten.gelu,
    _aten.silu,
    _aten.sigmoid,
    _aten.tanh,
    _aten.exp,
    _aten.log,
    _aten.pow,
    _aten.sqrt,
    _aten.rsqrt,
    _aten.abs,
    _aten.square,
    _aten.erf,
    _aten.masked_fill,
    _aten.where,
    _aten.dropout,
    _aten.native_dropout,
    _aten.clone,
    _aten.contiguous,
    _aten._to_copy,
    _aten.to,
    _aten.type_as,
    _aten.leaky_relu,
    _aten.elu,
    _aten.hardtanh,
    _aten.softplus,
    _aten.view,
    _aten.reshape,
    _aten._unsafe_view,
    _aten.transpose,
    _aten.permute,
    _aten.unsqueeze,
    _aten.squeeze,
    _aten.expand,
    _aten.flatten,
    _aten.split,
    _aten.split_with_sizes,
    _aten.chunk,
    _aten.matmul,
    _aten.bmm,
    _aten.softmax,
    _aten._softmax,
    _aten.scaled_dot_product_attention,
}


def head_count(mf) -> tuple[str, int] | None:
    """The model's attention head count, where it states one: a module-level `n_head` (or
    n_heads, num_heads, num_attention_heads) in the model file, else such an attribute on a module."""
    for name in _HEAD_COUNT_NAMES:
        value = (mf.globals or {}).get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{name} in {mf.path.name}", value
    return None


def check_degree(mf, model: nn.Module, tp: int) -> None:
    """Refuse, before any tracing, a tensor-parallel degree the model's heads cannot take."""
    heads = head_count(mf)
    for path, module in model.named_modules():
        for name in _HEAD_COUNT_NAMES:
            value = getattr(module, name, None)
            if heads is None and isinstance(value, int) and not isinstance(value, bool):
                heads = (f"{path or 'model'}.{name}", value)
    if heads and heads[1] % tp:
        raise AotError(f"--strategy tp={tp}: the tensor-parallel degree must divide the attention heads ({heads[0]} = {heads[1]})")


def user_plan(mf, model: nn.Module) -> dict[str, str] | None:
    """The model file's `tp_plan`, checked: module names that exist and are Linear, known styles."""
    plan = mf.tp_plan
    if plan is None:
        return None
    if callable(plan):
        plan = plan()
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise AotError(f'{mf.path.name}: tp_plan must map module names to "colwise" or "rowwise"')
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if name not in modules:
            raise AotError(f"{mf.path.name}: tp_plan names module {name!r}, which the model does not have")
        if style not in STYLES:
            raise AotError(f'{mf.path.name}: tp_plan[{name!r}] is {style!r}; expected "colwise" or "rowwise"')
        if not isinstance(modules[name], nn.Linear):
            raise AotError(f"{mf.path.name}: tp_plan names {name!r}, a {type(modules[name]).__name__}; only Linear layers can be sharded")
    return dict(plan)


def check_divisible(plan: dict[str, str], model: nn.Module, tp: int, where: str) -> None:
    modules = dict(model.named_modules())
    for name, style in plan.items():
        linear = modules[name]
        features, which = (linear.out_features, "output") if style == "colwise" else (linear.in_features, "input")
        if features % tp:
            raise AotError(f"--strategy tp={tp}: {where} shards {name!r} {style}, but its {features} {which} features do not divide by {tp}")


def find_plan(model: nn.Module, inputs: list[torch.Tensor]) -> dict[str, str]:
    """The Megatron-style plan read from the forward graph (see the module docstring)."""
    import contextlib
    import io

    from aot.capture.trace_logs import quiet_trace_logs

    try:
        # a failed export prints the partial graph to stderr; the user gets one line (below)
        with quiet_trace_logs(), contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(model, tuple(inputs), strict=False)
    except Exception as e:
        raise AotError(
            f"tensor parallel: the forward could not be traced to find the plan "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); give a tp_plan in the model file"
        ) from e
    graph = ep.graph
    linears = [n for n in graph.nodes if n.op == "call_function" and n.target == _aten.linear.default]
    module_of = {n: list(n.meta["nn_module_stack"].values())[-1][0] for n in linears}
    activations = _activation_nodes(graph, set(ep.graph_signature.user_inputs))

    walks = {a: _walk(a) for a in linears}
    plan: dict[str, str] = {}
    for start in linears:
        if module_of[start] in plan:
            continue
        group = _group(start, walks)
        if group is None:
            continue
        colwise, rowwise, region = group
        names = [module_of[n] for n in colwise | rowwise]
        if len(set(names)) != len(names) or any(n in plan for n in names):
            continue  # a module called twice, or one already taken by another pair
        if any(_foreign_operand(node, region | colwise, activations) for node in region | rowwise):
            continue
        if not _features_stay_split(graph, colwise, rowwise, region):
            continue
        plan.update({module_of[n]: "colwise" for n in colwise})
        plan.update({module_of[n]: "rowwise" for n in rowwise})
    return plan


def _activation_nodes(graph, user_inputs: set[str]) -> set:
    """Nodes whose values depend on the batch (as opposed to parameters, buffers and constants)."""
    result = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name in user_inputs) or any(i in result for i in node.all_input_nodes):
            result.add(node)
    return result


def _walk(linear):
    """(nodes between, Linears reached through their input, ok) following `linear`'s output."""
    region, reached, todo = set(), set(), list(linear.users)
    while todo:
        node = todo.pop()
        if node in region or node in reached:
            continue
        if node.op == "call_function" and node.target == _aten.linear.default and node.args[0] in region | {linear}:
            reached.add(node)
            continue
        packet = getattr(node.target, "overloadpacket", None)
        if node.op == "call_function" and (packet in _SHARD_LOCAL or node.target.__name__ == "getitem"):
            region.add(node)
            todo.extend(node.users)
            continue
        return region, reached, False  # an output, a reduction over features, another layer's weight...
    return region, reached, bool(reached)


def _group(start, walks):
    """Close `start` over the Linears that feed the same row-wise layers; None if any walk fails."""
    colwise, rowwise, region = {start}, set(), set()
    changed = True
    while changed:
        changed = False
        for a in list(colwise):
            walked_region, reached, ok = walks[a]
            if not ok:
                return None
            region |= walked_region
            if not reached <= rowwise:
                rowwise |= reached
                changed = True
        for a, (_, reached, _ok) in walks.items():
            if a not in colwise and reached & rowwise:
                colwise.add(a)
                changed = True
    if colwise & rowwise:
        return None
    return colwise, rowwise, region


def _foreign_operand(node, region: set, activations: set) -> bool:
    """Whether `node` also takes batch-dependent values from outside the sharded region (a
    residual stream, say): those are whole while the region's are shards."""
    inputs = node.all_input_nodes[:1] if node.target == _aten.linear.default else node.all_input_nodes
    return any(i in activations and i not in region for i in inputs)


def _features_stay_split(graph, colwise: set, rowwise: set, region: set) -> bool:
    """Follow which dimension holds the split features, from the column-wise outputs (the last
    dimension) through the region: every operation must keep them apart (never reduce, normalize
    or contract over them, never split them), and they must arrive at each row-wise layer as its
    input's last dimension. Shapes are the forward's full ones (node.meta["val"])."""
    split: dict = {c: c.meta["val"].dim() - 1 for c in colwise}
    for node in graph.nodes:
        if node in region:
            dim = _split_dim(node, split)
            if dim is None:
                return False
            split[node] = dim
    return all(split.get(b.args[0]) == b.args[0].meta["val"].dim() - 1 for b in rowwise)


def _shape(node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _split_dim(node, split: dict) -> int | None:
    """The output dimension holding the split features, or None where the op would mix them."""
    ins = [(i, split[i]) for i in node.all_input_nodes if i in split]
    packet = getattr(node.target, "overloadpacket", None)
    if node.target.__name__ == "getitem":
        return ins[0][1]
    src, dim = ins[0]
    in_shape, out = _shape(src), node.meta.get("val")
    out_shape = _shape(node) if isinstance(out, torch.Tensor) else in_shape
    if in_shape is None or out_shape is None:
        return None
    rank = len(in_shape)
    arg = lambda i, default=None: node.args[i] if len(node.args) > i else node.kwargs.get("dim", default)
    norm = lambda d: d % rank
    if packet in (_aten.split, _aten.split_with_sizes, _aten.chunk):
        return None if norm(arg(2, 0)) == dim else dim
    if packet in (_aten.softmax, _aten._softmax):
        return None if norm(arg(1)) == dim else dim
    if packet is _aten.transpose:
        a, b = norm(node.args[1]), norm(node.args[2])
        return b if dim == a else a if dim == b else dim
    if packet is _aten.permute:
        return [norm(d) for d in node.args[1]].index(dim)
    if packet in (_aten.view, _aten.reshape, _aten._unsafe_view, _aten.flatten, _aten.unsqueeze, _aten.squeeze):
        return _through_reshape(in_shape, dim, out_shape)
    if packet in (_aten.matmul, _aten.bmm):
        a, b = node.args[0], node.args[1]
        dims = set()
        for operand, contracted, _kept in ((a, -1, -2), (b, -2, -1)):
            if operand in split:
                rel = split[operand] - len(_shape(operand))
                if rel == contracted:
                    return None  # a contraction over split features gives partial sums
                dims.add(len(out_shape) + rel)
        return dims.pop() if len(dims) == 1 else None
    if packet is _aten.scaled_dot_product_attention:
        rels = {split[i] - len(_shape(i)) for i in node.args[:3] if i in split}
        return None if len(rels) != 1 or rels & {-1, -2} else len(out_shape) + rels.pop()
    # elementwise (and expand): dimensions line up from the right; whole operands must broadcast
    rels = {d - len(_shape(i)) for i, d in ins}
    if len(rels) != 1:
        return None
    rel = rels.pop()
    for other in node.all_input_nodes:
        shape = _shape(other)
        if other not in split and shape is not None and len(shape) >= -rel and shape[rel] != 1:
            return None
    return len(out_shape) + rel


def _through_reshape(in_shape: tuple, dim: int, out_shape: tuple) -> int | None:
    """Where dimension `dim` of `in_shape` lands in `out_shape`: the output dimension that starts
    at the same element offset and either splits it (taking its leading factor) or merges it
    with the dimensions after it (as their leading one)."""
    before = math.prod(in_shape[:dim])
    for e in range(len(out_shape)):
        if math.prod(out_shape[:e]) == before and (out_shape[e] != 1 or in_shape[dim] == 1):
            size, width = out_shape[e], in_shape[dim]
            return e if size % width == 0 or width % size == 0 else None
    return None


# -- sequence parallel ---------------------------------------------------------------------------

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm) if hasattr(nn, "RMSNorm") else (nn.LayerNorm, nn.GroupNorm)


def sequence_parallel_layout(model: nn.Module, plan: dict[str, str], where: str) -> dict[str, list[str]]:
    """Where sequence parallelism splits the residual stream, from the tensor-parallel plan.

    Each column/row-wise group sits in one module (its lowest common ancestor: an attention or MLP
    module) whose input is gathered whole along the sequence and whose output is reduce-scattered
    back; those modules sit in blocks, children of one container, that run one after another on the
    residual stream. Between the first block's input and the last block's output that stream is
    split along dimension 1 (the sequence), so the blocks' norms and dropouts run on 1/tp of the
    tokens. Returns {"regions", "norms", "blocks"} (module names, blocks in order)."""
    regions = set()
    for name in plan:
        parent = name.rpartition(".")[0]
        regions.add(parent)
    # Merge regions that are ancestors of one another (a plan naming modules at several depths).
    regions = {r for r in regions if not any(r != o and r.startswith(o + ".") for o in regions)}
    if "" in regions:
        raise AotError(
            f"--sequence-parallel: {where} splits layers at the top of the model; sequence parallelism needs them inside blocks (attention, MLP modules)"
        )
    blocks = sorted({r.rpartition(".")[0] for r in regions})
    containers = {b.rpartition(".")[0] for b in blocks}
    modules = dict(model.named_modules())
    if len(containers) != 1 or "" in blocks:
        raise AotError(f"--sequence-parallel: the split layers are not inside one stack of blocks (found {', '.join(blocks) or 'none'})")
    container = containers.pop()
    order = [f"{container}.{child}" if container else child for child, _ in modules[container].named_children()]
    positions = sorted(order.index(b) for b in blocks)
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise AotError(f"--sequence-parallel: blocks {', '.join(blocks)} are not consecutive in {container!r}")
    blocks = [order[i] for i in positions]
    norms = sorted(
        n for b in blocks for n, m in modules[b].named_modules(prefix=b) if isinstance(m, _NORMS) and not any(n.startswith(r + ".") or n == r for r in regions)
    )
    return {"regions": sorted(regions), "norms": norms, "blocks": blocks}


def check_sequence_length(model: nn.Module, inputs: list[torch.Tensor], first_block: str, tp: int) -> None:
    """The residual stream's dimension 1 must divide by tp: every rank must trace the same shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    module = dict(model.named_modules())[first_block]
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            model(*inputs)
    finally:
        handle.remove()
    if not seen or len(seen[0]) < 2:
        raise AotError(f"--sequence-parallel: {first_block} does not take a (batch, sequence, ...) tensor")
    if seen[0][1] % tp:
        raise AotError(f"--sequence-parallel with tp={tp}: the sequence length {seen[0][1]} does not divide by {tp}")
