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
from dataclasses import dataclass

import torch
from torch import nn

from aot.capture.listed_experts import stacked_layers
from aot.capture.tensor_parallel import transposed_linear
from aot.errors import AotError
from runner.format.sharding import tp_style

from aot.plan.tensor_parallel_trial import split_forward_failure

STYLES = ("colwise", "rowwise")
_HEAD_COUNT_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_KV_HEAD_COUNT_NAMES = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")

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
    _aten.view_as_complex,  # rotary embeddings through complex numbers (torchtitan's, Meta's Llama): each
    _aten.view_as_real,  # pair of features becomes one complex number within its head, and back
    _aten.split,
    _aten.split_with_sizes,
    _aten.chunk,
    _aten.unbind,
    _aten.slice,
    _aten.narrow,
    _aten.select,
    _aten.index_select,
    _aten.cat,
    _aten.stack,
    _aten.alias,
    _aten.detach,
    _aten.sum,
    _aten.mean,
    _aten.amax,
    _aten.amin,
    _aten.matmul,
    _aten.bmm,
    _aten.softmax,
    _aten._softmax,
    _aten.scaled_dot_product_attention,
}


def head_counts(mf, model: nn.Module) -> dict[str, tuple[str, int]]:
    """The attention head counts the model states: {"heads": (where, n), "kv heads": (where, n)}.
    Read from module-level names in the model file (n_head, n_kv_heads ...), else from attributes
    of its modules or of their `config` (transformers' models keep num_attention_heads and
    num_key_value_heads there)."""
    found: dict[str, tuple[str, int]] = {}
    places = [(mf.path.name, mf.globals or {})]
    for path, module in model.named_modules():
        places.append((f"{path or 'model'}", vars(module)))
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, (dict, list, tuple)):
            places.append((f"{path + '.' if path else ''}config", vars(config)))
    for kind, names in (("heads", _HEAD_COUNT_NAMES), ("kv heads", _KV_HEAD_COUNT_NAMES)):
        for where, values in places:
            name = next((n for n in names if _is_count(values.get(n))), None)
            if name is not None:
                found[kind] = (f"{name} in {where}" if where == mf.path.name else f"{where}.{name}", values[name])
                break
    return found


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_degree(mf, model: nn.Module, tp: int) -> None:
    """Refuse, before any tracing, a tensor-parallel degree the model's heads (and, with grouped-
    query attention, its key/value heads) cannot take: each rank computes whole heads."""
    for kind, (where, count) in head_counts(mf, model).items():
        if count % tp:
            raise AotError(f"--strategy tp={tp}: the tensor-parallel degree must divide the attention {kind} ({where} = {count})")


# A tp_plan entry for a module kept whole whose weights' gradients are per-rank parts summed over
# tp (transformers' own plans use the name): per-head norms inside split attention, say.
SUMMED = "replicated_with_grad_allreduce"


def _given_plan(mf) -> dict[str, str] | None:
    plan = mf.tp_plan
    if plan is None:
        return None
    if callable(plan):
        plan = plan()
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise AotError(f'{mf.path.name}: tp_plan must map module names to "colwise", "rowwise" or "{SUMMED}"')
    return plan


def summed_params(mf, model: nn.Module) -> tuple[str, ...]:
    """The parameters of the modules the model file's tp_plan marks "replicated_with_grad_allreduce"
    (their own, not their children's), sorted; the capture checks that each is such a weight."""
    plan = _given_plan(mf) or {}
    modules = dict(model.named_modules())
    names = []
    for name, style in plan.items():
        if style == SUMMED:
            if name not in modules:
                raise AotError(f"{mf.path.name}: tp_plan names module {name!r}, which the model does not have")
            names += [f"{name}.{leaf}" if name else leaf for leaf, _ in modules[name].named_parameters(recurse=False)]
    return tuple(sorted(names))


def user_plan(mf, model: nn.Module) -> dict[str, str] | None:
    """The model file's `tp_plan`, checked: module names that exist and are Linear (or
    transformers' Conv1D), known styles ("colwise", "rowwise", "colwise:K" for a layer whose
    output is K equal parts, each split: a fused q/k/v projection). Its "replicated_with_grad_allreduce"
    entries are not splits (`summed_params`); a plan of only those leaves the splits to the finder."""
    plan = _given_plan(mf)
    if plan is None:
        return None
    plan = {name: style for name, style in plan.items() if style != SUMMED}
    if not plan:
        return None
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if name not in modules:
            raise AotError(f"{mf.path.name}: tp_plan names module {name!r}, which the model does not have")
        if not _known_style(style):
            raise AotError(f'{mf.path.name}: tp_plan[{name!r}] is {style!r}; expected "colwise", "rowwise", "colwise:K" (K equal fused parts) or "{SUMMED}"')
        if not splittable(modules[name]):
            raise AotError(f"{mf.path.name}: tp_plan names {name!r}, a {type(modules[name]).__name__}; only Linear layers can be sharded")
    return dict(plan)


def _known_style(style: str) -> bool:
    kind, _, parts = style.partition(":")
    return kind in STYLES and (not parts or (kind == "colwise" and parts.isdigit() and int(parts) > 1))


def _features(module) -> tuple[int, int]:
    """(input, output) features of a Linear or of transformers' Conv1D (weight stored (in, out))."""
    if transposed_linear(module):
        return tuple(module.weight.shape)
    return module.in_features, module.out_features


def check_divisible(plan: dict[str, str], model: nn.Module, tp: int, where: str) -> None:
    modules = dict(model.named_modules())
    for name, style in plan.items():
        kind, parts = tp_style(style)
        inputs, outputs = _features(modules[name])
        features: float
        # each of a fused layer's parts is split alike (parts == 1 otherwise)
        if kind == "rowwise":
            features, which = inputs, "input features"
        else:
            features, which = outputs / parts, "output features" + (f" in each of its {parts} parts" if parts > 1 else "")
        if features % tp:
            raise AotError(f"--strategy tp={tp}: {where} shards {name!r} {style}, but its {features:g} {which} do not divide by {tp}")


@dataclass
class Finding:
    """The found plan, and why each Linear it leaves whole stays whole."""

    plan: dict[str, str]
    whole: dict[str, str]  # Linear module name -> why (the op that stopped it, as op and module)


def find_plan(model: nn.Module, inputs: list[torch.Tensor], size: int = 2) -> dict[str, str]:
    """The Megatron-style plan read from the forward graph (see the module docstring)."""
    return explain_plan(model, inputs, size).plan


# A forward that fails with its layers split is tried again without the failing kind of module's
# layers; one kind per try (nanoGPT's attention: one try), so a handful of tries is plenty.
MAX_TRIALS = 4


def explain_plan(model: nn.Module, inputs: list[torch.Tensor], size: int = 2, read: Finding | None = None) -> Finding:
    """find_plan, with the reason each Linear left out stays whole. The plan read from the graph
    (`read_plan`, or `read` where the caller has it: it does not depend on the degree) is then
    run (the forward on fake tensors, split over `size` ranks): the graph's shapes are
    numbers, so it cannot tell `view(B, T, self.n_head, hs)` (a head count fixed in code, which
    a rank's share of the heads cannot take) from `view(B, T, -1, hs)`. A module whose forward
    fails split keeps its layers whole, and every module of its class with it."""
    found = read if read is not None else read_plan(model, inputs)
    plan, whole = dict(found.plan), dict(found.whole)
    try:
        check_divisible(plan, model, size, "the found plan")
    except AotError:
        return found  # no run can split these layers evenly: the build refuses the degree (check_divisible)
    for _ in range(MAX_TRIALS):
        failure = split_forward_failure(model, plan, inputs, size)
        if failure is None:
            break
        module, why = failure
        kind = type(dict(model.named_modules())[module])
        owners = [name for name, m in model.named_modules() if type(m) is kind]
        dropped = [n for n in plan if any(n.startswith(f"{o}.") for o in owners)]
        for name in dropped:
            whole[name] = why
            del plan[name]
    else:
        plan = {}
    return Finding(plan, {name: why for name, why in whole.items() if name not in plan})


def read_plan(model: nn.Module, inputs: list[torch.Tensor]) -> Finding:
    """The pairs read from the exported forward graph (the module docstring), not yet run: the
    same at every degree (a planner asking for several reads it once)."""
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
    modules = dict(model.named_modules())
    # a ModuleList's experts stacked for ep stay whole, as 3-D experts weights do (aot/capture/listed_experts.py)
    stacked = tuple(f"{layer.module}." for layer in stacked_layers(model))
    projections = {n: i for n, i in _projections(graph, modules).items() if not _module_of(n).startswith(stacked)}
    linears = list(projections)
    module_of = {n: _module_of(n) for n in linears}
    activations = _activation_nodes(graph, set(ep.graph_signature.user_inputs))
    calls: dict[str, int] = {}
    for n in linears:
        calls[module_of[n]] = calls.get(module_of[n], 0) + 1

    walks = {a: _walk(a, projections) for a in linears}
    plan: dict[str, str] = {}
    whole: dict[str, str] = {}
    for start in linears:
        if module_of[start] in plan:
            continue
        colwise, rowwise, region, why = _group(start, walks)
        names = [module_of[n] for n in colwise | rowwise]
        if why is None and any(not splittable(modules.get(n)) for n in names):
            odd = next(n for n in names if not splittable(modules.get(n)))
            why = f"{odd} is a {type(modules.get(odd)).__name__}, not an nn.Linear (calls F.linear itself)"
        if why is None and any(calls[n] > 1 for n in names):
            why = f"{next(n for n in names if calls[n] > 1)} is called more than once in the forward"
        if why is None and any(n in plan for n in names):
            continue  # taken by another pair already
        if why is None:
            foreign = next((node for node in region | rowwise if _foreign_operand(node, region | colwise, activations, projections)), None)
            if foreign is not None:
                why = f"{_op_at(foreign)} also takes activations from outside the split layers (a residual stream)"
        fused: dict = {}
        if why is None:
            mixed = _features_stay_split(graph, colwise, rowwise, region, projections, fused)
            if mixed is not None:
                why = f"{_op_at(mixed)} would mix the split features"
        if why is not None:
            for name in names:
                whole.setdefault(name, why)
            continue
        plan.update({module_of[n]: f"colwise:{fused[n]}" if n in fused else "colwise" for n in colwise})
        plan.update({module_of[n]: "rowwise" for n in rowwise})
    in_order = {module_of[n]: plan[module_of[n]] for n in linears if module_of[n] in plan}
    return Finding(in_order, {name: why for name, why in whole.items() if name not in plan})


def _module_of(node) -> str:
    """The module a node of the exported forward was called from ("the model" at the top)."""
    stack = node.meta.get("nn_module_stack") or {}
    return (list(stack.values())[-1][0] if stack else "") or "the model"


def _op_at(node) -> str:
    """An op of the forward as a user finds it: `aten.mean in model.layers.0.post_attention_layernorm`."""
    if node.op == "output":
        return "the model's output"
    packet = getattr(node.target, "overloadpacket", node.target)
    return f"{getattr(packet, '__name__', str(packet)).replace('.default', '')} in {_module_of(node)}"


def _activation_nodes(graph, user_inputs: set[str]) -> set:
    """Nodes whose values depend on the batch (as opposed to parameters, buffers and constants)."""
    result = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name in user_inputs) or any(i in result for i in node.all_input_nodes):
            result.add(node)
    return result


@dataclass
class _Walk:
    region: set  # the nodes between the Linear and the Linears it reaches
    reached: set  # Linears that take the walked values as their input
    stop: object  # the node that ended the walk (an output, a reduction...), or None

    @property
    def why(self) -> str | None:
        """What ended the walk, as "output reaches ..." (None where it reached Linears)."""
        if self.stop is not None:
            return f"output reaches {_op_at(self.stop)}"
        return None if self.reached else "output reaches no other Linear"


def _projections(graph, modules: dict) -> dict:
    """The forward's projections (node -> the argument index of its input): `aten.linear` calls,
    and the `aten.addmm` of transformers' Conv1D (GPT-2's Linear with its weight stored (in, out))."""
    found = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == _aten.linear.default:
            found[node] = 0
        elif node.target == _aten.addmm.default and transposed_linear(modules.get(_module_of(node))):
            found[node] = 1
    return found


def splittable(module) -> bool:
    """A layer tensor parallelism can split: an nn.Linear, or transformers' Conv1D."""
    return isinstance(module, nn.Linear) or transposed_linear(module)


def _walk(linear, projections: dict) -> _Walk:
    """Follow `linear`'s output through shard-local ops to the projections taking it as input."""
    region: set[torch.fx.Node] = set()
    reached: set[torch.fx.Node] = set()
    todo = list(linear.users)
    while todo:
        node = todo.pop()
        if node in region or node in reached:
            continue
        if node in projections and node.args[projections[node]] in region | {linear}:
            reached.add(node)
            continue
        if node.op == "call_function" and node.target is _aten._assert_tensor_metadata.default:
            continue  # export's dtype checks on the values: no result, nothing computed
        packet = getattr(node.target, "overloadpacket", None)
        if node.op == "call_function" and (packet in _SHARD_LOCAL or node.target.__name__ == "getitem"):
            region.add(node)
            todo.extend(node.users)
            continue
        return _Walk(region, reached, node)  # an output, a reduction over features, another layer's weight...
    return _Walk(region, reached, None)


def _group(start, walks: dict) -> tuple[set, set, set, str | None]:
    """Close `start` over the Linears that feed the same row-wise layers: (column-wise, row-wise,
    the nodes between, None), or the reason it cannot be split as the last item."""
    colwise = {start}
    rowwise: set[torch.fx.Node] = set()
    region: set[torch.fx.Node] = set()
    changed = True
    while changed:
        changed = False
        for a in list(colwise):
            walk = walks[a]
            if walk.why is not None:
                return colwise, rowwise, region, (f"its {walk.why}" if a is start else f"{_module_of(a)}'s {walk.why}")
            region |= walk.region
            if not walk.reached <= rowwise:
                rowwise |= walk.reached
                changed = True
        for a, walk in walks.items():
            if a not in colwise and walk.reached & rowwise:
                colwise.add(a)
                changed = True
    if colwise & rowwise:
        layer = _module_of(next(iter(colwise & rowwise)))
        return colwise, rowwise, region, f"{layer} would be both column- and row-wise"
    return colwise, rowwise, region, None


def _foreign_operand(node, region: set, activations: set, projections: dict) -> bool:
    """Whether `node` also takes batch-dependent values from outside the sharded region (a
    residual stream, say): those are whole while the region's are shards."""
    inputs = [node.args[projections[node]]] if node in projections else node.all_input_nodes
    return any(i in activations and i not in region for i in inputs)


def _features_stay_split(graph, colwise: set, rowwise: set, region: set, projections: dict, fused: dict):
    """Follow which dimension holds the split features, from the column-wise outputs (the last
    dimension) through the region: every operation must keep them apart (never reduce, normalize
    or contract over them, never split them), and they must arrive at each row-wise layer as its
    input's last dimension. Shapes are the forward's full ones (node.meta["val"]). Returns the
    first node that would mix them, None where they stay split.

    One exception: a column-wise output cut into K equal parts along its features (GPT-2's fused
    q, k, v: `c_attn(x).split(n_embd, dim=2)`) keeps each part split when each rank holds the same
    slice of every part (`fused`: column-wise node -> K; the build shards such a weight per part,
    runner/format/sharding.py tp_slice)."""
    split: dict = {c: c.meta["val"].dim() - 1 for c in colwise}
    for node in graph.nodes:
        if node in region:
            dim = _split_dim(node, split)
            if dim is None:
                parts = _equal_parts(node, split)
                source = _only_source(node.args[0], colwise) if parts else None
                if source is None or fused.setdefault(source, parts) != parts:
                    return node
                dim = split[node.args[0]]
            split[node] = dim
    inputs = {b: b.args[projections[b]] for b in rowwise}
    return next((b for b, i in inputs.items() if split.get(i) != i.meta["val"].dim() - 1), None)


def _equal_parts(node, split: dict) -> int | None:
    """K where `node` cuts its input's split dimension into K > 1 equal parts (split, chunk)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in (_aten.split, _aten.split_with_sizes, _aten.chunk) or node.args[0] not in split:
        return None
    shape, dim = _shape(node.args[0]), split[node.args[0]]
    axis = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if shape is None or axis % len(shape) != dim:
        return None
    size, how = shape[dim], node.args[1]
    if packet is _aten.chunk:
        parts = how if size % how == 0 else None
    elif packet is _aten.split:
        parts = size // how if size % how == 0 else None
    else:
        parts = len(how) if len(set(how)) == 1 else None
    return parts if parts and parts > 1 else None


def _only_source(node, colwise: set):
    """The column-wise projection whose output `node` is, through reshapes nothing else reads."""
    while node not in colwise:
        if getattr(node.target, "overloadpacket", None) not in (_aten.view, _aten.reshape, _aten._unsafe_view) or len(node.users) != 1:
            return None
        node = node.args[0]
    return node if len(node.users) == 1 else None


def _shape(node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _ndim(node) -> int:
    """Dimensions of a split value an op reads: a tensor (a split op's tuple is read through getitem)."""
    shape = _shape(node)
    assert shape is not None
    return len(shape)


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
    if packet in (_aten.slice, _aten.narrow, _aten.index_select):
        # within a head or feature the split keeps whole (RoPE's rotate_half); a slice of the
        # split dimension itself only where it takes all of it
        return dim if norm(arg(1, 0)) != dim or (packet is not _aten.index_select and out_shape[dim] == in_shape[dim]) else None
    if packet in (_aten.sum, _aten.mean, _aten.amax, _aten.amin):
        # a reduction over other dimensions (a stack's, a sequence's); over the split one, or all,
        # it would sum shards
        reduced = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        reduced = [norm(d) for d in ([reduced] if isinstance(reduced, int) else reduced or [])]
        if not reduced or dim in reduced:
            return None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return dim if keepdim else dim - sum(d < dim for d in reduced)
    if packet in (_aten.select, _aten.unbind):
        taken = norm(arg(1, 0))
        return None if taken == dim else dim - 1 if taken < dim else dim
    if packet in (_aten.cat, _aten.stack):
        tensors = node.args[0]
        rels = {split[t] - _ndim(t) for t in tensors if t in split}
        if len(rels) != 1 or any(t not in split for t in tensors):
            return None  # a whole tensor joined to shards, or shards split along different dimensions
        at = rank + rels.pop()
        joined = arg(1, 0) % (rank + (packet is _aten.stack))
        if packet is _aten.cat:
            return None if joined == at else at
        return at + 1 if joined <= at else at
    if packet is _aten.transpose:
        a, b = norm(node.args[1]), norm(node.args[2])
        return b if dim == a else a if dim == b else dim
    if packet is _aten.permute:
        return [norm(d) for d in node.args[1]].index(dim)
    if packet in (_aten.view, _aten.reshape, _aten._unsafe_view, _aten.flatten, _aten.unsqueeze, _aten.squeeze, _aten.view_as_complex, _aten.view_as_real):
        return _through_reshape(in_shape, dim, out_shape)
    if packet in (_aten.matmul, _aten.bmm):
        a, b = node.args[0], node.args[1]
        dims = set()
        for operand, contracted, _kept in ((a, -1, -2), (b, -2, -1)):
            if operand in split:
                rel = split[operand] - _ndim(operand)
                if rel == contracted:
                    return None  # a contraction over split features gives partial sums
                dims.add(len(out_shape) + rel)
        return dims.pop() if len(dims) == 1 else None
    if packet is _aten.scaled_dot_product_attention:
        rels = {split[i] - _ndim(i) for i in node.args[:3] if i in split}
        return None if len(rels) != 1 or rels & {-1, -2} else len(out_shape) + rels.pop()
    # elementwise (and expand): dimensions line up from the right; whole operands must broadcast
    rels = {d - _ndim(i) for i, d in ins}
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
