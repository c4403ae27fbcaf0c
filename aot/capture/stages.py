"""Pipeline stages: one microbatch's forward and loss traced as one graph and cut into stages.

`trace_forward` records forward and loss on fake tensors (make_fx), every node knowing its module
call (aot/capture/module_calls.py). `cut` gives every node a stage (its layer's, where
aot.plan.pipeline.split put it; else the latest of its inputs'; a node computed from graph inputs
alone goes where it is first needed, so a weight's transpose or a target's reshape is not sent)
and torch.fx's split_module makes each stage's forward a GraphModule. A value one stage makes and
a later one reads crosses as a point-to-point transfer (aot/capture/pipeline.py).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, replace

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from aot.capture.expert_parallel import Dispatches
from aot.capture.model_file import ModelFile, call_user
from aot.capture.module_calls import annotate_module_calls, layer_of
from aot.capture.model_file import describe_error
from aot.capture.step import StepLayout, _autocast_region, experts_of, rank_state, traced_as_compiled
from aot.capture.tensor_parallel import rename_group, tensor_parallel
from aot.capture.tensor_parallel_regions import differentiable_regions
from aot.capture.trace_logs import quiet_trace_logs
from aot.capture.training_state import TrainingState
from aot.errors import AotError


MOE_CAPACITY = "aot_moe_capacity"  # forward graph and last stage module meta: rows each rank sends each expert, or None


@dataclass(frozen=True)
class Source:
    """Where one input of a stage's forward comes from: a parameter or buffer (`name`), the
    microbatch's input `index` or its targets, or output `index` of stage `stage`."""

    kind: str  # "param" | "buffer" | "input" | "target" | "stage"
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
    outputs: list[tuple[list[int], torch.dtype, bool]]  # shape, dtype, carries a gradient
    layers: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)


def trace_forward(
    mf: ModelFile, state: TrainingState, layout: StepLayout, inputs: list[torch.Tensor], targets: torch.Tensor
) -> tuple[torch.fx.GraphModule, list[Source]]:
    """Forward and loss of one microbatch as a graph of the parameters as a rank uses them (whole,
    or its tensor-parallel slice), the buffers, the inputs and the targets; and what each of its
    inputs is. Under tensor parallelism the split layers run as DTensors, traced as the first and
    the last tp rank (which must agree, as aot.capture.step.capture_step checks), and the graph's
    tp collectives are made differentiable the way Megatron's are (`_tensor_parallel_autograd`)."""
    if layout.tp is None:
        return _trace_forward(mf, state, layout, inputs, targets, None)
    traced = []
    for rank in (0, layout.tp.size - 1):
        with tensor_parallel(state.model, dict(layout.tp_plan), layout.tp.size, layout.tp.name, layout.sequence, rank=rank) as tp:
            graph, sources = _trace_forward(mf, state, layout, inputs, targets, tp)
            rename_group(graph, tp.mesh.get_group().group_name, layout.tp.name)
        traced.append((graph, sources))
    if traced[0][0].code != traced[1][0].code:
        raise AotError(
            "tensor parallel: the traced forward differs between tp ranks (a whole tensor is split by rank "
            "inside the model); this plan cannot run as one program, change tp_plan"
        )
    graph, sources = traced[0]
    named = {p: source for p, source in zip((n for n in graph.graph.nodes if n.op == "placeholder"), sources) if source.kind == "param"}
    split = layout.tp_dims(state)
    differentiable_regions(graph, dict(layout.tp_plan), layout.tp.name, set(named), {p for p, source in named.items() if source.name in split}, layout.sequence)
    return graph, sources


def _trace_forward(mf, state, layout, inputs, targets, tp):
    param_names, buffer_names = list(state.params), list(state.buffers)
    n_params, n_buffers = len(param_names), len(buffer_names)
    model = state.model if tp is None else tp.model
    full_shapes = {n: p.shape for n, p in state.params.items()}

    dispatches = Dispatches()

    def forward(*flat):
        used = dict(zip(param_names, flat[:n_params]))
        if tp is not None:
            used = tp.wrap(used, full_shapes)
        tensors = {**used, **dict(zip(buffer_names, flat[n_params : n_params + n_buffers]))}
        with _autocast_region(layout.precision):
            outputs = torch.func.functional_call(model, tensors, tuple(flat[n_params + n_buffers : -1]))
            loss = call_user(mf.loss, "loss(outputs, targets)", mf.path, outputs, flat[-1])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise AotError(f"{mf.path.name}: loss(outputs, targets) must return a scalar tensor")
        if dispatches.dropped:  # an expert capacity: the microbatch's dropped choices, a second output (see cut)
            return loss, torch.stack(dispatches.dropped).sum()
        return loss

    local = rank_state(state, replace(layout, fsdp=None))
    # the parameters require grad, as in training: composite ops choose their kernels by it (scaled dot
    # product attention takes the math path for a mask that needs a gradient, T5's position bias), and
    # the stages replay this forward under autograd (aot/capture/pipeline.py)
    params = [p.detach().requires_grad_(p.is_floating_point()) for p in local.params.values()]
    args = [*params, *state.buffers.values(), *inputs, targets]
    sources = [
        *(Source("param", n) for n in param_names),
        *(Source("buffer", n) for n in buffer_names),
        *(Source("input", index=i) for i in range(len(inputs))),
        Source("target"),
    ]
    try:
        with traced_as_compiled(), quiet_trace_logs(), annotate_module_calls(model), experts_of(model, layout, dispatches):
            graph = make_fx(forward, tracing_mode="fake")(*args)
    except AotError:
        raise
    except Exception as e:
        raise AotError(f"{mf.path.name}: the forward cannot be traced: {describe_error(e, mf.path)}") from e
    graph.meta[MOE_CAPACITY] = max(dispatches.capacity) if dispatches.capacity else None
    return graph, sources


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
                raise AotError(
                    f"pipeline: the forward updates buffer {source_of[written].name!r} in place (BatchNorm's "
                    f"running statistics?), which microbatches would update once each; not supported with pp yet"
                )
    computed = [n for n in graph.graph.nodes if n.op == "call_function"]
    stage: dict = {}
    for node in computed:  # a layer's stage, else the latest of its inputs'
        layer = layer_of(node)
        found = [stage[a] for a in node.all_input_nodes if a in stage and stage[a] is not None]
        own = stage_of_layer[layer] if layer is not None else None
        stage[node] = own if own is not None else max(found, default=None)
        if own is not None and found and max(found) > own:
            raise AotError(f"pipeline: layer {layer} reads a value of a later stage (stage {max(found)}); the model's forward must run its layers in order")
    output = graph.graph.output_node()
    for node in reversed(computed):  # computed from graph inputs alone: where it is first needed
        if stage[node] is None:
            users = [stage[u] for u in node.users if u is not output and stage.get(u) is not None]
            stage[node] = min(users, default=stages - 1)
    loss = output.args[0]
    for extra in loss[1:] if isinstance(loss, (list, tuple)) else ():
        assert isinstance(extra, torch.fx.Node)  # the forward's outputs: the loss and the dropped count
        _to_last_stage(extra, stage, stages - 1)
    loss = loss[0] if isinstance(loss, (list, tuple)) else loss
    if stage.get(loss) != stages - 1:
        raise AotError(
            f"pipeline: the loss is computed in stage {stage.get(loss)}, not the last ({stages - 1}): there are fewer layers after the cut than stages"
        )
    used = sorted(set(stage.values()))
    if used != list(range(stages)):
        missing = sorted(set(range(stages)) - set(used))
        raise AotError(f"pipeline: stage(s) {missing} would compute nothing; use fewer stages")
    # partitions in dependency order (a stage's nodes need not come before the next stage's in the
    # graph: a tensor-parallel weight slice's view is made at the top, where DTensor unwraps it)
    split = split_module(graph, graph, lambda n: stage[n])  # root_m "Not currently used" (torch 2.13's docstring)
    cut_stages = _stages(split, source_of, stages)
    _outputs_in_graph_order(split, cut_stages[-1])
    cut_stages[-1].module.meta[MOE_CAPACITY] = graph.meta.get(MOE_CAPACITY)  # with the count it is the capacity of
    return cut_stages


def _to_last_stage(value: torch.fx.Node, stage: dict, last: int) -> None:
    """A forward output besides the loss (the dropped-choice count of an expert capacity) made in
    the last stage, with the nodes outside every layer that only feed it (the stack and sum of the
    layers' counts): the last stage's outputs are then the forward's, and the layers' counts travel
    to it as any stage output does."""
    stage[value] = last
    for a in value.all_input_nodes:
        if a in stage and layer_of(a) is None and all(stage.get(u) == last for u in a.users):
            _to_last_stage(a, stage, last)


def _outputs_in_graph_order(split: torch.fx.GraphModule, last: Stage) -> None:
    """The last stage's outputs ordered as the forward returns them (the loss first), whatever
    order split_module gave them."""
    returned = split.graph.output_node().args[0]
    if not isinstance(returned, (list, tuple)) or len(returned) < 2:
        return
    order = [typing.cast(int, typing.cast(torch.fx.Node, node).args[1]) for node in returned]  # getitems of the last stage's outputs
    out_node = last.module.graph.output_node()
    values = out_node.args[0]
    assert isinstance(values, tuple)  # _stages makes every stage return a tuple
    out_node.args = (tuple(values[i] for i in order),)
    last.module.recompile()
    last.outputs = [last.outputs[i] for i in order]
    last.readers = [last.readers[i] for i in order]


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
    assert isinstance(values, (list, tuple))  # _stages makes every stage return a tuple
    return [v in found for v in values]


def _stages(split: torch.fx.GraphModule, source_of: dict, count: int) -> list[Stage]:
    produced: dict = {}  # top-level node (a submodule's output) -> (stage, output index)
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
        flags = _carries_gradient(module, [s.kind == "param" or (s.kind == "stage" and result[s.stage].outputs[s.index][2]) for s in sources])
        outputs = [(list(v.meta["val"].shape), v.meta["val"].dtype, flag) for v, flag in zip(values, flags)]
        stage = Stage(
            index,
            module,
            sources,
            [[] for _ in values],
            outputs,
            params=[s.name for s in sources if s.kind == "param"],
            buffers=[s.name for s in sources if s.kind == "buffer"],
        )
        stage.layers = sorted(
            {layer for n in module.graph.nodes if n.op == "call_function" and (layer := layer_of(n)) is not None},
            key=lambda name: [int(p) if p.isdigit() else p for p in name.split(".")],
        )
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
