"""Pipeline parallelism at capture: one microbatch's forward cut into stages, and each pipeline
rank's whole step with its schedule unrolled into one graph.

1. `trace_forward`: forward and loss of one microbatch as one graph of aten ops (make_fx, fake),
   every node knowing its module call (aot/capture/module_calls.py).
2. `cut`: every node gets a stage (its layer's, else the latest of its inputs'; a node computed
   from graph inputs alone goes where it is first needed, so a weight's transpose or a target's
   reshape is not sent), and torch.fx's split_module makes each stage's forward a GraphModule. A
   value one stage makes and a later one reads crosses as a point-to-point transfer.
3. `capture_pipeline`: the step of one pipeline rank (the stages it holds) traced with make_fx:
   the schedule's actions in order, each a stage forward of one microbatch (its inputs received
   with `irecv`, its outputs sent with `isend`: graph nodes, _c10d_functional) or its backward
   (`torch.autograd.grad` from the received output gradients, the input gradients sent back).
   Then the gradients summed over microbatches are reduced and the optimizer steps, as in the
   single-stage step (aot/capture/step.py's `finish`).

The loss is the mean over microbatches (each microbatch's loss is divided by their number, as
torch.distributed.pipelining scales it), so a step equals one eager step over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from aot.capture.model_file import ModelFile, call_user
from aot.capture.module_calls import annotate_module_calls, layer_of
from aot.capture.step import (CapturedStep, Group, StepLayout, _autocast_region, _describe_trace_error, _gather,
                              _optimizer_tracing, _step_args, _step_program, rank_state)
from aot.capture.tensor_parallel import rename_group, tensor_parallel
from aot.capture.trace_logs import quiet_trace_logs
from aot.capture.training_state import TrainingState
from aot.errors import AotError

_funcol = torch.ops._c10d_functional


@dataclass(frozen=True)
class Source:
    """Where one input of a stage's forward comes from: a parameter or buffer (`name`), the
    microbatch's input `index` or its targets, or output `index` of stage `stage`."""
    kind: str            # "param" | "buffer" | "input" | "target" | "stage"
    name: str = ""
    index: int = 0
    stage: int = -1


@dataclass
class Stage:
    """One stage's forward of one microbatch: `module(*inputs from sources)` -> outputs, of which
    output j is read by the stages `readers[j]` (the last stage's only output is the loss)."""
    index: int
    module: torch.fx.GraphModule
    sources: list[Source]
    readers: list[list[int]]
    outputs: list[tuple[list[int], torch.dtype, bool]]   # shape, dtype, carries a gradient
    layers: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)


def trace_forward(mf: ModelFile, state: TrainingState, layout: StepLayout, inputs: list[torch.Tensor],
                  targets: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Source]]:
    """Forward and loss of one microbatch as a graph of the parameters as a rank uses them (whole,
    or its tensor-parallel slice), the buffers, the inputs and the targets; and what each of its
    inputs is. Under tensor parallelism the split layers run as DTensors, traced as the first and
    the last tp rank (which must agree, as aot.capture.step.capture_step checks), and the graph's
    tp collectives are made differentiable the way Megatron's are (`_tensor_parallel_autograd`)."""
    if layout.tp is None:
        return _trace_forward(mf, state, layout, inputs, targets, None)
    if layout.sequence is not None:
        raise AotError("--sequence-parallel is not supported with pp yet")
    traced = []
    for rank in (0, layout.tp.size - 1):
        with tensor_parallel(state.model, dict(layout.tp_plan), layout.tp.size, layout.tp.name, layout.sequence,
                             rank=rank) as tp:
            graph, sources = _trace_forward(mf, state, layout, inputs, targets, tp)
            rename_group(graph, tp.mesh.get_group().group_name, layout.tp.name)
        traced.append((graph, sources))
    if traced[0][0].code != traced[1][0].code:
        raise AotError("tensor parallel: the traced forward differs between tp ranks (a whole tensor is split by rank "
                       "inside the model); this plan cannot run as one program, change tp_plan")
    graph, sources = traced[0]
    named = {p: source for p, source in zip((n for n in graph.graph.nodes if n.op == "placeholder"), sources)
             if source.kind == "param"}
    split = layout.tp_dims(state)
    _tensor_parallel_autograd(graph, dict(layout.tp_plan), layout.tp.name, set(named),
                              {p for p, source in named.items() if source.name in split})
    return graph, sources


def _trace_forward(mf, state, layout, inputs, targets, tp):
    param_names, buffer_names = list(state.params), list(state.buffers)
    n_params, n_buffers = len(param_names), len(buffer_names)
    model = state.model if tp is None else tp.model
    full_shapes = {n: p.shape for n, p in state.params.items()}

    def forward(*flat):
        used = dict(zip(param_names, flat[:n_params]))
        if tp is not None:
            used = tp.wrap(used, full_shapes)
        tensors = {**used, **dict(zip(buffer_names, flat[n_params:n_params + n_buffers]))}
        with _autocast_region(layout.precision):
            outputs = torch.func.functional_call(model, tensors, tuple(flat[n_params + n_buffers:-1]))
            loss = call_user(mf.loss, "loss(outputs, targets)", mf.path, outputs, flat[-1])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise AotError(f"{mf.path.name}: loss(outputs, targets) must return a scalar tensor")
        return loss

    local = rank_state(state, replace(layout, fsdp=None))
    args = [*local.params.values(), *state.buffers.values(), *inputs, targets]
    sources = [*(Source("param", n) for n in param_names), *(Source("buffer", n) for n in buffer_names),
               *(Source("input", index=i) for i in range(len(inputs))), Source("target")]
    try:
        with quiet_trace_logs(), annotate_module_calls(model):
            graph = make_fx(forward, tracing_mode="fake")(*args)
    except AotError:
        raise
    except Exception as e:
        raise AotError(f"{mf.path.name}: the forward cannot be traced: {_describe_trace_error(e, mf)}") from e
    return graph, sources


# -- tensor parallelism in a replayed forward ------------------------------------------------------
# A stage replays the cut forward graph under autograd. DTensor's backward collectives live in its
# autograd functions, which a graph of aten ops no longer has: a column-wise layer's input needs
# its gradient all-reduced over tp (the slices of the input gradient are partial sums), and the
# all_reduce after a row-wise layer passes its gradient through unchanged. These are Megatron's
# "copy to" and "reduce from" the tensor-parallel region; the graph gets them back as calls of
# the two functions below (the stage's trace records their collectives as graph nodes).

class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _funcol.wait_tensor(_funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _funcol.wait_tensor(_funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: str) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: str) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


def _tensor_parallel_autograd(graph: torch.fx.GraphModule, plan: dict[str, str], group: str, params: set,
                              split: set) -> None:
    """`params`: the placeholders of parameters, `split` those tp splits. A value made from split
    parameters alone (a weight slice's view or transpose) is the rank's own: no all_reduce. One
    made from whole parameters only and read inside a row-wise layer (its bias, which DTensor
    divides by the tp degree so the layer's all_reduce adds it once) gets a partial gradient on
    each rank: summed, as DTensor's Replicate -> Partial redistribution sums it."""
    g = graph.graph
    copies: dict = {}
    derived = {p: {p} for p in params}   # parameter-only values -> the parameter placeholders they come from
    for node in g.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(a in derived for a in node.all_input_nodes):
            derived[node] = set().union(*(derived[a] for a in node.all_input_nodes))
    for node in list(g.nodes):
        calls = {name for name, _ in node.meta.get("custom", {}).get("aot_module_calls", ())}
        styles = {plan[c] for c in calls if c in plan}
        if node.op != "call_function" or not styles:
            continue
        for a in node.all_input_nodes:
            inside = {name for name, _ in a.meta.get("custom", {}).get("aot_module_calls", ())}
            val = a.meta.get("val")
            if calls & inside & set(plan) or not isinstance(val, torch.Tensor) or not val.is_floating_point():
                continue
            if a in derived:  # a weight: only a whole one read by a row-wise layer needs the sum
                if "rowwise" not in styles or derived[a] & split:
                    continue
            elif a.op == "placeholder" or "colwise" not in styles:
                continue
            if a not in copies:
                with g.inserting_after(a):
                    copies[a] = g.call_function(copy_to_tensor_parallel, (a, group))
                copies[a].meta.update(val=val, custom=dict(a.meta.get("custom", {})))
            node.replace_input_with(a, copies[a])
    for node in list(g.nodes):
        if node.op == "call_function" and node.target is _funcol.all_reduce.default and node.args[2] == group:
            waits = [u for u in node.users if u.target is _funcol.wait_tensor.default]
            with g.inserting_before(node):
                reduced = g.call_function(reduce_from_tensor_parallel, (node.args[0], group))
            reduced.meta.update(node.meta)
            for w in waits:
                w.replace_all_uses_with(reduced)
                g.erase_node(w)
            g.erase_node(node)
    g.lint()
    graph.recompile()


def layers(graph: torch.fx.GraphModule) -> list[str]:
    """The model's layers (calls of numbered children: `blocks.3`, `0`) in the order forward runs them."""
    found = []
    for node in graph.graph.nodes:
        layer = layer_of(node)
        if layer is not None and layer not in found:
            found.append(layer)
    return found


def cut(graph: torch.fx.GraphModule, sources: list[Source], stage_of_layer: dict[str, int], stages: int) -> list[Stage]:
    """Each stage's forward, from the layer -> stage assignment (aot.plan.pipeline.split)."""
    graph.graph.eliminate_dead_code()  # values nothing reads (DTensor's empty placeholders) belong to no stage
    graph.recompile()
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    source_of = dict(zip(placeholders, sources))
    for node in graph.graph.nodes:  # a buffer updated in place would be updated once per microbatch
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        for i, arg in enumerate(schema.arguments if schema is not None else ()):
            written = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and source_of.get(written, Source("")).kind == "buffer":
                raise AotError(f"pipeline: the forward updates buffer {source_of[written].name!r} in place (BatchNorm's "
                               f"running statistics?), which microbatches would update once each; not supported with pp yet")
    computed = [n for n in graph.graph.nodes if n.op == "call_function"]
    stage: dict = {}
    for node in computed:  # a layer's stage, else the latest of its inputs'
        layer = layer_of(node)
        found = [stage[a] for a in node.all_input_nodes if a in stage and stage[a] is not None]
        own = stage_of_layer[layer] if layer is not None else None
        stage[node] = own if own is not None else max(found, default=None)
        if own is not None and found and max(found) > own:
            raise AotError(f"pipeline: layer {layer} reads a value of a later stage (stage {max(found)}); "
                           f"the model's forward must run its layers in order")
    output = graph.graph.output_node()
    for node in reversed(computed):  # computed from graph inputs alone: where it is first needed
        if stage[node] is None:
            users = [stage[u] for u in node.users if u is not output and stage.get(u) is not None]
            stage[node] = min(users, default=stages - 1)
    loss = output.args[0]
    loss = loss[0] if isinstance(loss, (list, tuple)) else loss
    if stage.get(loss) != stages - 1:
        raise AotError(f"pipeline: the loss is computed in stage {stage.get(loss)}, not the last ({stages - 1}): "
                       f"there are fewer layers after the cut than stages")
    used = sorted(set(stage.values()))
    if used != list(range(stages)):
        missing = sorted(set(range(stages)) - set(used))
        raise AotError(f"pipeline: stage(s) {missing} would compute nothing; use fewer stages")
    # partitions in dependency order (a stage's nodes need not come before the next stage's in the
    # graph: a tensor-parallel weight slice's view is made at the top, where DTensor unwraps it)
    split = split_module(graph, None, lambda n: stage[n])
    return _stages(split, source_of, stages)


def _carries_gradient(module: torch.fx.GraphModule, inputs: list[bool]) -> list[bool]:
    """Which outputs of a stage's forward depend, through floating-point values, on an input that
    carries a gradient (a parameter, or a received value that does): their gradients flow back."""
    found = {p for p, flag in zip((n for n in module.graph.nodes if n.op == "placeholder"), inputs) if flag}
    for node in module.graph.nodes:
        if node.op == "call_function" and any(a in found for a in node.all_input_nodes):
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.is_floating_point():
                found.add(node)
    values = module.graph.output_node().args[0]
    return [v in found for v in values]


def _stages(split: torch.fx.GraphModule, source_of: dict, count: int) -> list[Stage]:
    produced: dict = {}   # top-level node (a submodule's output) -> (stage, output index)
    result: dict[int, Stage] = {}
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(node.target.removeprefix("submod_"))
        module = getattr(split, node.target)
        sources = []
        for a in node.args:
            if a.op == "placeholder":
                sources.append(source_of[next(p for p in source_of if p.name == a.name)])
            else:
                stage, out = produced[a]
                sources.append(Source("stage", index=out, stage=stage))
        out_node = module.graph.output_node()
        values = out_node.args[0]
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not isinstance(out_node.args[0], (list, tuple)):  # one output: return it as a tuple of one, like the others
            out_node.args = ((out_node.args[0],),)
            module.recompile()
        flags = _carries_gradient(module, [s.kind == "param" or (s.kind == "stage" and result[s.stage].outputs[s.index][2])
                                           for s in sources])
        outputs = [(list(v.meta["val"].shape), v.meta["val"].dtype, flag) for v, flag in zip(values, flags)]
        stage = Stage(index, module, sources, [[] for _ in values], outputs,
                      params=[s.name for s in sources if s.kind == "param"],
                      buffers=[s.name for s in sources if s.kind == "buffer"])
        stage.layers = sorted({layer_of(n) for n in module.graph.nodes if n.op == "call_function" and layer_of(n) is not None},
                              key=lambda name: [int(p) if p.isdigit() else p for p in name.split(".")])
        for user in node.users:
            if user.op == "call_function" and user.args[0] is node:  # getitem of a tuple of outputs
                produced[user] = (index, user.args[1])
        if len(values) == 1:
            produced[node] = (index, 0)
        result[index] = stage
    if sorted(result) != list(range(count)):
        raise AotError(f"pipeline: the cut made stages {sorted(result)}, expected 0 .. {count - 1}")
    stages = [result[i] for i in range(count)]
    for stage in stages:
        for source in stage.sources:
            if source.kind == "stage":
                stages[source.stage].readers[source.index].append(stage.index)
    return stages


# -- one pipeline rank's step ---------------------------------------------------------------------

def tag(microbatch: int, producer: int, consumer: int, output: int, backward: bool) -> int:
    """The p2p tag of one transfer, the same on both sides: unique per microbatch, stage pair,
    value and direction, so transfers match whatever order they are issued in."""
    return (((microbatch * 64 + producer) * 64 + consumer) * 64 + output) * 2 + int(backward)


@dataclass(frozen=True)
class Pipeline:
    """The pipeline a rank's program runs: `pp` ranks over group `group`, `stages` in all (v per
    rank, stage c * pp + r on rank r), `microbatches` per step and the rank's `actions`
    (aot.plan.pipeline.Action: kind "F" or "B", microbatch, chunk)."""
    group: Group
    rank: int
    stages: tuple
    microbatches: int
    actions: tuple

    @property
    def held(self) -> list:
        return [s for s in self.stages if s.index % self.group.size == self.rank]

    def peer(self, stage: int) -> int:
        """The rank, within the pipeline group, that runs `stage`."""
        return stage % self.group.size


def stage_state(state: TrainingState, params: list[str], buffers: list[str]) -> TrainingState:
    """The training state restricted to one pipeline rank's parameters and buffers."""
    keep = set(params)
    groups = [[n for n in g if n in keep] for g in state.param_groups]
    kept_groups = [i for i, g in enumerate(groups) if g]
    return replace(
        state,
        params={n: p for n, p in state.params.items() if n in keep},
        buffers={n: b for n, b in state.buffers.items() if n in set(buffers)},
        optimizer_slots=[(n, k) for n, k in state.optimizer_slots if n in keep],
        param_groups=[groups[i] for i in kept_groups],
        hyperparameters=[state.hyperparameters[i] for i in kept_groups],
        lr_schedule=[[row[i] for i in kept_groups] for row in state.lr_schedule],
    )


def tied_params(stages: list[Stage], pp: int) -> list[str]:
    """Parameters more than one pipeline rank holds (a tied embedding and output layer)."""
    holders: dict = {}
    for s in stages:
        for name in s.params:
            holders.setdefault(name, set()).add(s.index % pp)
    return [n for n, ranks in holders.items() if len(ranks) > 1]


def capture_pipeline(mf: ModelFile, state: TrainingState, pipeline: Pipeline, layout: StepLayout,
                     inputs: list[torch.Tensor], targets: torch.Tensor) -> CapturedStep:
    """The step of one pipeline rank as one graph (its stages' parameters, buffers and optimizer
    state, the learning rates, the rank's whole batch)."""
    held = pipeline.held
    names = [n for n in state.params if any(n in s.params for s in held)]
    buffer_names = [n for n in state.buffers if any(n in s.buffers for s in held)]
    own = stage_state(state, names, buffer_names)
    tied = tied_params(list(pipeline.stages), pipeline.group.size)
    first_holder = {n: min(s.index % pipeline.group.size for s in pipeline.stages if n in s.params) for n in tied}
    # the global norm counts a tied weight once: on the first rank holding it
    uncounted = tuple(n for n in names if n in tied and first_holder[n] != pipeline.rank)
    layout = replace(layout, pp=pipeline.group, pp_uncounted=uncounted)
    _, finish = _step_program(mf, own, len(inputs), layout, None)
    args, slots = _step_args(own, layout, inputs, targets)
    kept = [i for i, g in enumerate(state.param_groups) if any(n in names for n in g)]
    slots = [{**slot, "group": kept[slot["group"]]} if slot["kind"] == "lr" else slot for slot in slots]
    # what a rank's gradient of each tied weight looks like (its fsdp shard), for ranks without it
    tied_like = {n: t for n, t in rank_state(stage_state(state, tied, []), layout).params.items()}
    step = _pipeline_step(own, pipeline, layout, len(inputs), finish, tied_like)
    try:
        with _optimizer_tracing(), quiet_trace_logs():
            graph = make_fx(step, tracing_mode="fake")(*args)
    except AotError:
        raise
    except Exception as e:
        raise AotError(f"{mf.path.name}: pipeline rank {pipeline.rank}'s step cannot be traced: "
                       f"{_describe_trace_error(e, mf)}") from e
    return CapturedStep(graph=graph, slots=slots, example_args=[a.detach() for a in args])


def _pipeline_step(own: TrainingState, pipeline: Pipeline, layout: StepLayout, n_inputs: int, finish, tied: dict):
    from runner.artifact import SCALER_KEYS
    from aot.capture.loss_scaling import LossScaling

    param_names, buffer_names = list(own.params), list(own.buffers)
    n_params, n_buffers, n_state, n_groups = len(param_names), len(buffer_names), len(own.optimizer_slots), len(own.param_groups)
    precision = layout.precision
    n_scaler = len(SCALER_KEYS) if precision.scaler else 0
    local_shapes = layout.local_shapes(own)
    pp, group, rank, m = pipeline.group.size, pipeline.group.name, pipeline.rank, pipeline.microbatches
    stages = {s.index: s for s in pipeline.stages}
    last = len(pipeline.stages) - 1

    def step(*flat):
        params = list(flat[:n_params])
        buffers = dict(zip(buffer_names, flat[n_params:n_params + n_buffers]))
        opt_state = flat[n_params + n_buffers:n_params + n_buffers + n_state]
        at = n_params + n_buffers + n_state
        lrs = flat[at:at + n_groups]
        scaling = LossScaling(precision.scaler, *flat[at + n_groups:at + n_groups + n_scaler]) if n_scaler else None
        batch_inputs, batch_targets = flat[-1 - n_inputs:-1], flat[-1]
        size = batch_targets.shape[0] // m
        by_name = dict(zip(param_names, params))
        if layout.fsdp is not None:  # gathered once per step; the gradients are reduce-scattered once, after all microbatches
            gathered = {n: _gather(p, local_shapes[n], layout.fsdp, precision) for n, p in by_name.items()}
            leaves = {n: g.detach().requires_grad_() for n, g in gathered.items()}
        else:
            leaves = by_name
        sums: dict = {}
        saved: dict = {}     # (microbatch, stage) -> (outputs, received leaves)
        local: dict = {}     # transfers between stages on this rank: (tag) -> tensor
        sent = []
        loss_sum = batch_targets.new_zeros((), dtype=torch.float32)

        def receive(like_shape, dtype, peer_stage, t):
            if peer_stage % pp == rank:
                return local.pop(t)
            buffer = torch.empty(like_shape, dtype=dtype)
            return _funcol.wait_tensor(_funcol.irecv(buffer, pipeline.peer(peer_stage), t, group))

        def send(tensor, peer_stage, t):
            if peer_stage % pp == rank:
                local[t] = tensor
            else:
                sent.append(_funcol.isend(tensor.contiguous(), pipeline.peer(peer_stage), t, group))

        for action in pipeline.actions:
            s = stages[action.stage(rank, pp)]
            mb = action.microbatch
            if action.kind == "F":
                values, received = [], []
                for source in s.sources:
                    if source.kind == "param":
                        values.append(leaves[source.name])
                    elif source.kind == "buffer":
                        values.append(buffers[source.name])
                    elif source.kind == "input":
                        values.append(batch_inputs[source.index][mb * size:(mb + 1) * size])
                    elif source.kind == "target":
                        values.append(batch_targets[mb * size:(mb + 1) * size])
                    else:
                        shape, dtype, grad = stages[source.stage].outputs[source.index]
                        x = receive(shape, dtype, source.stage, tag(mb, source.stage, s.index, source.index, False))
                        if grad:
                            x = x.detach().requires_grad_()
                            received.append((source, x))
                        values.append(x)
                outputs = s.module(*values)
                for j, readers in enumerate(s.readers):
                    for reader in readers:
                        send(outputs[j].detach(), reader, tag(mb, s.index, reader, j, False))
                if s.index == last:
                    loss_sum = loss_sum + outputs[0].detach().float()
                saved[(mb, s.index)] = (outputs, received)
            else:
                outputs, received = saved.pop((mb, s.index))
                if s.index == last:
                    loss = outputs[0] / m
                    roots, seeds = [scaling.scaled(loss) if scaling else loss], None
                else:
                    roots, seeds = [], []
                    for j, readers in enumerate(s.readers):
                        if not readers or not s.outputs[j][2]:
                            continue
                        shape, dtype, _ = s.outputs[j]
                        grads = [receive(shape, dtype, r, tag(mb, s.index, r, j, True)) for r in readers]
                        roots.append(outputs[j])
                        seeds.append(sum(grads[1:], grads[0]))
                wrt_params = [n for n in s.params if n in leaves and leaves[n].requires_grad]
                wrt = [leaves[n] for n in wrt_params] + [x for _, x in received]
                grads = torch.autograd.grad(roots, wrt, seeds, allow_unused=True) if roots else [None] * len(wrt)
                for n, g in zip(wrt_params, grads):
                    if g is not None:
                        sums[n] = g if n not in sums else sums[n] + g
                for (source, x), g in zip(received, grads[len(wrt_params):]):
                    send(g if g is not None else torch.zeros_like(x), source.stage,
                         tag(mb, source.stage, s.index, source.index, True))
        for handle in sent:  # every send done before the step ends
            _funcol.wait_tensor(handle)
        if layout.fsdp is not None:
            present = [n for n in param_names if n in sums]
            reduced = torch.autograd.grad([gathered[n] for n in present], [by_name[n] for n in present],
                                          [sums[n] for n in present])
            sums = dict(zip(present, reduced))
        # One all_reduce over the pipeline group (the same on every rank, whatever a pass could
        # reorder): the last stage's loss for every rank, and the gradients of weights two ranks
        # hold (a tied embedding and output layer) summed, as Megatron does.
        pieces = [(loss_sum / m).reshape(1)]
        for name, like in tied.items():
            mine = sums.get(name)
            pieces.append((mine if mine is not None else torch.zeros_like(like)).reshape(-1).float())
        total = _funcol.wait_tensor(_funcol.all_reduce(torch.cat(pieces), "sum", group))
        local_loss = total[0]
        at = 1
        for name, like in tied.items():
            if name in by_name:
                sums[name] = total[at:at + like.numel()].reshape(like.shape).to(like.dtype)
            at += like.numel()
        grads = [sums.get(n) for n in param_names]
        return finish(params, grads, local_loss, opt_state, lrs, scaling)

    return step
