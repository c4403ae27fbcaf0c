"""Traces the planner prices: the build's (aot/capture/step.py), made where the planner can make them cheaper.

- `trace_for_pricing`: make_fx's graph of the step on fake tensors, as the build traces it, without
  generating the graph's Python code (the planner reads graphs, never runs them).
- `derive_without_fsdp`: the graph of a mesh without fsdp, read from the graph of the same mesh
  with fsdp=2 plus a trace of the step's end alone.

tests/test_plan_derived_graphs.py checks both against the build's own traces, and
tests/test_plan_recompute.py that recomputation chooses on the planner's graphs what it chooses on
the build's.
"""

from __future__ import annotations

import torch

from aot.capture.model_file import ModelFile
from aot.capture.step import StepLayout, traced_as_compiled, step_args, step_program
from aot.capture.trace_logs import quiet_trace_logs
from aot.capture.training_state import TrainingState


# -- a graph without fsdp from the graph with it (the planner) ------------------------------------


def derive_without_fsdp(
    mf: ModelFile, state: TrainingState, inputs: list[torch.Tensor], targets: torch.Tensor, layout: StepLayout, sharded: torch.fx.GraphModule, fsdp_group: str
):
    """The planner's graph of `layout`, a mesh without fsdp, from `sharded`: the graph (profiler calls
    dropped, plain collectives) of a mesh with the same tensor-parallel degree and an fsdp axis
    (group `fsdp_group`). The forward and backward of the sharded step are the unsharded step's ops
    on the gathered parameters: each parameter is gathered (all_gather, wait, slice, view) before
    anything else runs, and its gradient is scattered (view, slice_backward, reduce_scatter, wait)
    after the whole backward (autograd runs those last, newest parameter first). So the unsharded
    graph is the ops in between, reading the parameters themselves, followed by the step's end
    (`finish`: averaging, clipping, the optimizer) traced alone on whole parameters, each node
    created as the trace of the unsharded step creates it (same order, names and values).

    Returns (graph module, slots, [(node, node whose storage it shares in one trace)]: the gathered
    buffers are the parameters, the end's gradient and loss inputs are the backward's; the cost
    model counts each such pair as one allocation), or None where `sharded`
    is not of this form (every parameter gathered and scattered once, nothing else in between):
    the unsharded mesh is then traced."""
    import operator

    from aot.passes import CLEANUP, run_passes

    funcol, aten = torch.ops._c10d_functional, torch.ops.aten
    n_params, n_buffers = len(state.params), len(state.buffers)
    n_state, n_groups = len(state.optimizer_slots), len(state.param_groups)
    nodes = list(sharded.graph.nodes)
    holders = [n for n in nodes if n.op == "placeholder"]
    if (
        len(holders) != n_params + n_buffers + n_state + n_groups + len(inputs) + 1
        or not n_params
        or any(n.op not in ("placeholder", "call_function", "output") for n in nodes)
    ):
        return None
    position = {n: i for i, n in enumerate(nodes)}

    def only_user(node, target):
        users = list(node.users)
        return users[0] if len(users) == 1 and users[0].target is target else None

    whole, buffers, gathered = [], [], set()
    for param in holders[:n_params]:
        gathers = [u for u in param.users if u.target is funcol.all_gather_into_tensor.default and u.args[-1] == fsdp_group]
        if len(gathers) != 1:
            return None
        chain = [gathers[0]]
        for target in (funcol.wait_tensor.default, aten.slice.Tensor, aten.view.default):
            chain.append(only_user(chain[-1], target))
            if chain[-1] is None:
                return None
        gathered.update(chain)
        buffers.append(chain[1])
        whole.append(chain[3])
    scatters = [n for n in nodes if n.target is funcol.reduce_scatter_tensor.default and n.args[-1] == fsdp_group]
    if len(scatters) != n_params:
        return None
    numels = [s.numel() for s in layout.local_shapes(state).values()]
    grads: list[torch.fx.node.Argument] = [None] * n_params
    scattered: set[torch.fx.Node] = set()
    for i, scatter in zip(reversed(range(n_params)), scatters):  # newest parameter first
        pad = scatter.args[0]
        view = pad.args[0] if isinstance(pad, torch.fx.Node) and pad.args else None
        wait = only_user(scatter, funcol.wait_tensor.default)
        size = scatter.args[2] if len(scatter.args) > 2 else None
        if (
            getattr(pad, "target", None) is not aten.slice_backward.default
            or not isinstance(view, torch.fx.Node)
            or view.target is not aten.view.default
            or wait is None
            or not isinstance(size, int)
            or list(pad.args[1]) != [-(-numels[i] // size) * size]
            or tuple(pad.args[2:5]) != (0, 0, numels[i])
        ):
            return None
        scattered.update((view, pad, scatter, wait))
        grads[i] = view.args[0]
    first, last = min(position[n] for n in scattered), max(position[n] for n in scattered)
    start = max(position[n] for n in gathered) + 1
    core = nodes[start:first]
    if (
        any(n.op != "placeholder" and n not in gathered for n in nodes[:start])
        or any(n not in scattered for n in nodes[first : last + 1])
        or any(n.op != "call_function" or n in gathered or n in scattered for n in core)
    ):
        return None
    inside = set(core)
    readable = inside | set(whole) | set(holders[n_params : n_params + n_buffers]) | set(holders[-1 - len(inputs) :])
    output = nodes[-1]
    local_loss = output.args[0][0] if output.op == "output" and isinstance(output.args[0], (tuple, list)) else None
    if any(a not in readable for n in core for a in n.all_input_nodes) or local_loss not in inside or any(g not in inside for g in grads):
        return None

    # the step's end alone, on this layout's whole parameters and on gradients like the backward's
    _, finish = step_program(mf, state, len(inputs), layout, None)
    args, slots = step_args(state, layout, inputs, targets)

    def like(node):
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.storage_offset() != 0:
            raise _NotDerivable("gradient layout")
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)

    def end(*flat):
        params = list(flat[:n_params])
        return finish(
            params,
            tuple(flat[n_params : 2 * n_params]),
            flat[2 * n_params],
            flat[2 * n_params + 1 : 2 * n_params + 1 + n_state],
            flat[2 * n_params + 1 + n_state :],
        )

    state_at = n_params + n_buffers
    try:
        end_args = [*args[:n_params], *(like(g) for g in grads), like(local_loss), *args[state_at : state_at + n_state + n_groups]]
        with traced_as_compiled(), quiet_trace_logs():
            tail = run_passes(trace_for_pricing(end, end_args), only=CLEANUP)
    except Exception:  # noqa: BLE001  (the unsharded mesh is traced, and reports any error)
        return None
    tail_nodes = list(tail.graph.nodes)
    tail_holders = [n for n in tail_nodes if n.op == "placeholder"]
    if any(n.op not in ("placeholder", "call_function", "output") for n in tail_nodes):
        return None

    graph = torch.fx.Graph()
    env: dict = {}

    def holder(k: int, source):
        node = graph.create_node("placeholder", f"arg{k}_1", (), {}, name=f"arg{k}_1")
        node.meta["val"] = source.meta.get("val")
        env[source] = node
        return node

    rest = [*holders[n_params : n_params + n_buffers], *tail_holders[2 * n_params + 1 :], *holders[-1 - len(inputs) :]]
    made = [holder(k, source) for k, source in enumerate([*tail_holders[:n_params], *rest])]
    for i in range(n_params):
        env[whole[i]] = made[i]
        # the value forward reads (the gathered parameter: its storage is the tail's parameter's,
        # `shared` below), so that forward's values are of one trace (one fake mode), as a pass
        # that computes new values from them (recomputation) needs
        made[i].meta["val"] = whole[i].meta.get("val")
    mapped = lambda a: torch.fx.node.map_arg(a, lambda n: env[n])  # noqa: E731

    def copy(node) -> None:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            name = graph._target_to_str(target.overloadpacket.__name__)
        elif target is operator.getitem:
            name = None
        else:
            raise _NotDerivable(str(target))
        new = graph.create_node("call_function", target, mapped(node.args), mapped(node.kwargs), name=name)
        new.meta["val"] = node.meta.get("val")
        if "custom" in node.meta:  # the module calls it comes from (aot.capture.module_calls)
            new.meta["custom"] = node.meta["custom"]
        env[node] = new

    try:
        for node in core:
            copy(node)
        for i in range(n_params):
            env[tail_holders[n_params + i]] = env[grads[i]]
        env[tail_holders[2 * n_params]] = env[local_loss]
        for node in tail_nodes:
            if node.op == "call_function":
                copy(node)
        graph.create_node("output", "output", (mapped(tail_nodes[-1].args[0]),), {})
    except (KeyError, _NotDerivable):
        return None

    shared = [(buffers[i], tail_holders[i]) for i in range(n_params)]
    shared += [(tail_holders[n_params + i], grads[i]) for i in range(n_params)]
    shared.append((tail_holders[2 * n_params], local_loss))
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        return _make_graph_module(torch.nn.Module(), graph, "step"), slots, shared


def storage_aliases(shared) -> dict:
    """derive_without_fsdp's [(node, node whose storage it shares)] as the cost model's aliases
    (storage key -> storage key, aot.plan.step_reading.analyze)."""
    from aot.capture.graph_reading import storage_key

    return {storage_key(a.meta["val"]): storage_key(b.meta["val"]) for a, b in shared}


# -- tracing for the planner ---------------------------------------------------------------------


class _NotDerivable(Exception):
    """A node derive_without_fsdp cannot copy as the trace of the mesh would make it: that mesh is traced."""


def trace_for_pricing(step, args: list) -> torch.fx.GraphModule:
    """make_fx(step, tracing_mode="fake")(*args), the build's trace (aot.capture.step.fake_make_fx:
    a lazy graph module, whose Python code is generated only if something calls it)."""
    from aot.capture.step import fake_make_fx

    return fake_make_fx(step, args)
