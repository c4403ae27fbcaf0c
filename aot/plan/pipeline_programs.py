"""The programs of a pipeline mesh, as the build makes them and the planner prices them: one
microbatch's forward traced and cut into stages where aot.plan.pipeline.split says, the schedule
checked, and every pipeline rank's step captured (aot/capture/pipeline.py) and finished by the
graph passes."""

from __future__ import annotations

from dataclasses import dataclass

from aot.capture.module_calls import layer_of
from aot.capture.pipeline import Pipeline, capture_pipeline, draws_random
from aot.capture.stages import Stage, cut, trace_forward
from aot.capture.step import CapturedStep, Group, StepLayout
from aot.errors import AotError
from aot.plan.cost_model import node_seconds
from aot.plan.pipeline import check, schedule_actions, split


@dataclass
class PipelinePrograms:
    stages: list[Stage]
    actions: list[list]  # per pipeline rank (aot.plan.pipeline.Action)
    captures: list[CapturedStep]  # per pipeline rank, passes applied


def pipeline_programs(
    mf,
    state,
    layout: StepLayout,
    group: Group,
    inputs,
    targets,
    *,
    microbatches: int,
    schedule: str,
    virtual: int,
    compute,
    finish,
    stage=None,
    note=lambda line: None,
    recompute: bool = False,
) -> PipelinePrograms:
    """`finish(gm)`: the graph passes; `stage(title)`: a progress context per part (None: none);
    `recompute`: every stage's forward runs again in its backward (aot.capture.pipeline.run_stage)."""
    from contextlib import nullcontext

    stage = stage or (lambda title: nullcontext())
    pp, count = group.size, group.size * virtual
    size = targets.shape[0] // microbatches
    with stage(f"tracing one microbatch's forward and cutting it into {count} stages"):
        forward, sources = trace_forward(mf, state, layout, [t[:size] for t in inputs], targets[:size])
        stage_of_layer = split(
            forward,
            count,
            lambda n: node_seconds(n, compute),
            layer_of,
            mf.globals.get("pp_split"),
            where=f"{mf.path.name}: pp_split",
            weighted=_weighted_layers(forward, sources),
        )
        stages = cut(forward, sources, stage_of_layer, count)
    for r in range(pp):
        if not any(s.params for s in stages if s.index % pp == r):
            held = [layer for s in stages if s.index % pp == r for layer in s.layers]
            raise AotError(
                f"pipeline rank {r} would hold no parameters (layers {', '.join(held)}): use fewer stages, "
                f"or a pp_split that gives every rank a layer with weights"
            )
    for s in stages:
        note(f"stage {s.index} on pipeline rank {s.index % pp}: {_span(s.layers)}, {sum(state.params[n].numel() for n in s.params):,} parameters")
    if recompute:
        for s in stages:
            drawn = draws_random(s.module)
            if drawn is not None:
                raise AotError(
                    f"recomputing stages with pp: stage {s.index} ({_span(s.layers)}) draws random numbers ({drawn}, dropout?), "
                    f"which a recomputed forward would draw again differently; disable dropout or do not recompute"
                )
    actions = schedule_actions(schedule, pp, microbatches, virtual)
    check(actions, microbatches, virtual)
    captures = []
    for r in range(pp):
        with stage(f"capturing pipeline rank {r}'s step ({len(actions[r])} forward and backward actions) and running graph passes"):
            pipeline = Pipeline(group, r, tuple(stages), microbatches, tuple(actions[r]), recompute)
            captured = capture_pipeline(mf, state, pipeline, layout, inputs, targets)
            captured.graph = finish(captured.graph)
        captures.append(captured)
    return PipelinePrograms(stages, actions, captures)


def _span(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{len(layers)} layers {layers[0]} .. {layers[-1]}"


def _weighted_layers(forward, sources) -> set[str]:
    """The layers whose ops read a parameter (directly, or through a view of it made elsewhere)."""
    params = {p for p, src in zip((n for n in forward.graph.nodes if n.op == "placeholder"), sources) if src.kind == "param"}
    found = set()
    for node in forward.graph.nodes:
        if node.op != "call_function":
            continue
        if node.all_input_nodes and all(a in params for a in node.all_input_nodes) and layer_of(node) is None:
            params.add(node)  # a weight's view outside any layer (DTensor unwraps slices at the top)
        elif layer_of(node) is not None and any(a in params for a in node.all_input_nodes):
            found.add(layer_of(node))
    return found
