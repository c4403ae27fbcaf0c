"""The pipeline-parallel part of `aot build --strategy pp=N[,dp=..,fsdp=..]`: one program per
pipeline rank.

One microbatch's forward is traced and cut into stages between layers (aot/capture/pipeline.py),
balanced by the cost model or where the model file's `pp_split` says (aot/plan/pipeline.py); the
schedule (gpipe, 1f1b, interleaved-1f1b) is checked and unrolled into each pipeline rank's step,
which the usual passes then optimize. The manifest's `pipeline` entry records the stages, their
layers and parameters, and the schedule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from aot.capture.module_calls import layer_of
from aot.capture.pipeline import Pipeline, capture_pipeline, cut, tied_params, trace_forward
from aot.capture.step import CapturedStep, Group, StepLayout
from aot.errors import AotError
from aot.plan.cost_model import analyze, node_seconds
from aot.plan.pipeline import bubble_fraction, check, chunks_of, schedule_actions, split
from aot.plan.pipeline_timeline import simulate_pipeline
from aot.plan.search import Planner, time_entry

PROGRAM_PREFIX = "train.pp"
TIMELINE_FILE = "pipeline/timeline.json"


@dataclass
class PipelineBuild:
    captures: dict[str, CapturedStep]   # program name -> its step
    memory: object                      # the predicted memory of the rank that needs most
    time: dict                          # the manifest's `time`, the slowest rank's, with the bubble
    recompute: dict
    entry: dict                         # the manifest's `pipeline`
    program_of: Callable[[dict], str]   # a rank's coordinates -> its program's name
    files: dict[str, bytes]             # the predicted timeline of every pipeline rank


def check_options(options, pp: int, model_globals: dict, model, name: str) -> tuple[int, int]:
    """(stages per rank, microbatches), refusing what the pipeline cannot take before any tracing."""
    from aot.plan.pipeline import check_microbatches
    virtual = chunks_of(options.pp_schedule, options.stages_per_rank)
    microbatches = options.microbatches or pp * (1 if virtual == 1 else 1)
    check_microbatches(options.pp_schedule, pp, microbatches, options.batch_size)
    pp_split = model_globals.get("pp_split")
    if pp_split is not None:
        modules = dict(model.named_modules())
        if not isinstance(pp_split, (list, tuple)) or not all(isinstance(n, str) for n in pp_split):
            raise AotError(f'{name}: pp_split must be a list of module names where stages 1, 2, ... begin, such as ["blocks.4"]')
        missing = [n for n in pp_split if n not in modules]
        if missing:
            raise AotError(f"{name}: pp_split names {missing[0]!r}, which is not a module of the model")
        if len(pp_split) != pp * virtual - 1:
            raise AotError(f"{name}: pp_split names {len(pp_split)} module(s) for {pp * virtual} stages: it needs {pp * virtual - 1}")
    return virtual, microbatches


def pipeline_programs(options, mf, state, layout: StepLayout, mesh, placement, machine, group: Group, inputs, targets,
                      request, finish, progress) -> PipelineBuild:
    pp = group.size
    if layout.tp is not None:
        # A stage replays the cut forward graph under autograd; tp's backward collectives live in
        # DTensor's autograd functions, which that graph no longer has (see the note)
        raise AotError("--strategy: pp with tp is not supported yet (pp composes with dp and fsdp)")
    if not request.none and request.source not in ("device memory",):
        raise AotError(f"{request.source}: recomputing activations is not supported with pp yet")
    virtual, microbatches = check_options(options, pp, mf.globals, state.model, mf.path.name)
    stages_count = pp * virtual
    size = options.batch_size // microbatches
    with progress.stage(f"tracing one microbatch's forward and cutting it into {stages_count} stages"):
        forward, sources = trace_forward(mf, state, layout, [t[:size] for t in inputs], targets[:size])
        stage_of_layer = split(forward, stages_count, lambda n: node_seconds(n, machine.compute), layer_of,
                               mf.globals.get("pp_split"), where=f"{mf.path.name}: pp_split")
        stages = cut(forward, sources, stage_of_layer, stages_count)
    for s in stages:
        progress.note(f"stage {s.index} on pipeline rank {s.index % pp}: {_span(s.layers)}, "
                      f"{sum(state.params[n].numel() for n in s.params):,} parameters")
    tied = tied_params(stages, pp)
    if tied:
        progress.note(f"tied across stages (gradients summed over the pipeline group): {', '.join(tied)}")
    actions = schedule_actions(options.pp_schedule, pp, microbatches, virtual)
    check(actions, microbatches, virtual)
    captures = {}
    for r in range(pp):
        with progress.stage(f"capturing pipeline rank {r}'s step ({len(actions[r])} forward and backward actions) "
                            f"and running graph passes"):
            captured = capture_pipeline(mf, state, Pipeline(group, r, tuple(stages), microbatches, tuple(actions[r])),
                                        layout, inputs, targets)
            captured.graph = finish(captured.graph)
        captures[f"{PROGRAM_PREFIX}{r}"] = captured
    analyses = {name: analyze(c.graph, c.slots) for name, c in captures.items()}
    peak = max(analyses, key=lambda n: analyses[n].memory.peak)
    times = {name: time_entry(machine, mesh, placement, a, options.bucket_mb) for name, a in analyses.items()}
    # the programs side by side: where each waits for another is the bubble
    timeline = simulate_pipeline([captures[f"{PROGRAM_PREFIX}{r}"].graph for r in range(pp)], Planner(machine, None),
                                 placement, group.name)
    busiest = max(range(pp), key=lambda r: timeline.busy_s[r])
    time = times[f"{PROGRAM_PREFIX}{busiest}"]
    time["predicted"] = {**time["predicted"], "step_s": timeline.step_s,
                         "bubble_s": timeline.step_s - timeline.busy_s[busiest]}
    bubble = bubble_fraction(options.pp_schedule, pp, microbatches, virtual)
    entry = {
        "axis": "pp", "group": group.name, "size": pp, "schedule": options.pp_schedule, "microbatches": microbatches,
        "microbatch_size": size, "stages_per_rank": virtual, "predicted_bubble": bubble,
        "stages": [{"stage": s.index, "rank": s.index % pp, "program": f"{PROGRAM_PREFIX}{s.index % pp}",
                    "layers": s.layers, "params": s.params, "buffers": s.buffers} for s in stages],
        "tied": tied,
        "actions": {f"{PROGRAM_PREFIX}{r}": [str(a) for a in acts] for r, acts in enumerate(actions)},
        "programs": {f"{PROGRAM_PREFIX}{r}": {"peak_bytes": analyses[f"{PROGRAM_PREFIX}{r}"].memory.peak,
                                              "busy_s": timeline.busy_s[r], "waiting_s": timeline.waiting_s[r]}
                     for r in range(pp)},
        "timeline": TIMELINE_FILE,
    }
    recompute = {"policy": "none", "source": request.source if not request.none else "none"}
    files = {TIMELINE_FILE: (json.dumps(timeline.trace, separators=(",", ":")) + "\n").encode()}
    return PipelineBuild(captures, analyses[peak].memory, time, recompute, entry,
                         lambda coords: f"{PROGRAM_PREFIX}{coords.get('pp', 0)}", files)


def _span(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{len(layers)} layers {layers[0]} .. {layers[-1]}"
