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

from aot.capture.eval_step import capture_pipeline_eval, eval_mode
from aot.capture.pipeline import Pipeline, tied_params
from aot.capture.stages import cut, trace_forward
from aot.capture.step import CapturedStep, StepLayout
from aot.compile_step import Recording
from aot.passes import CLEANUP, PassOptions, run_passes
from aot.target import Target
from aot.errors import AotError
from aot.passes.recompute import has_checkpoint_calls
from aot.plan.cost_model import Memory
from aot.plan.step_reading import analyze
from aot.plan.pipeline import bubble_fraction, chunks_of
from aot.plan.pipeline_programs import Reporting, Schedule, pipeline_programs
from aot.plan.pipeline_timeline import simulate_pipeline
from aot.plan.build_plan import time_entry
from aot.plan.search import Planner
from runner.commands.formatting import human
from runner.format.axes import PP

PROGRAM_PREFIX = "train.pp"
TIMELINE_FILE = "pipeline/timeline.json"


@dataclass
class PipelineBuild:
    captures: dict[str, CapturedStep]  # program name -> its step
    memory: Memory  # the predicted memory of the rank that needs most
    time: dict  # the manifest's `time`, the slowest rank's, with the bubble
    recompute: dict
    entry: dict  # the manifest's `pipeline`
    program_of: Callable[[dict], str]  # a rank's coordinates -> its program's name
    files: dict[str, bytes]  # the predicted timeline of every pipeline rank
    evaluation: dict[str, CapturedStep]  # eval program name -> its capture, per pipeline rank


def check_options(options, pp: int, model_globals: dict, model, name: str) -> tuple[int, int]:
    """(stages per rank, microbatches), refusing what the pipeline cannot take before any tracing."""
    from aot.plan.pipeline import check_microbatches

    virtual = chunks_of(options.pp_schedule, options.stages_per_rank)
    microbatches = options.microbatches or pp
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


def stage_recompute_entry(request, recomputed: bool, plain: dict | None) -> dict:
    """The manifest's `memory.recompute` for a pipeline: policy "stages" where every stage's
    forward runs again in its backward, else "none"; `plain`: the programs' analyses without
    recomputation, where they were made (their peak is then recorded)."""
    entry: dict = {"policy": "stages" if recomputed else "none", "source": request.source if not request.none else "none"}
    if request.memory_bytes is not None:
        entry["memory_budget_bytes"] = request.memory_bytes
    if request.fraction is not None:
        entry["activation_budget"] = request.fraction
    if recomputed and plain is not None:
        entry["peak_without_recompute"] = max(a.memory.peak for a in plain.values())
    return entry


def build_programs(options, rec: Recording, layout: StepLayout, target: Target, where: tuple, request, passes: PassOptions, progress) -> PipelineBuild:
    """Every pipeline rank's program for `target` (`where`: its mesh, placement and machine),
    recomputing every stage where `request` asks or the plain programs do not fit its budget."""
    mesh, placement, machine = where
    group = target.group(PP)
    assert group is not None  # a pipeline target
    pp = group.size
    mf, state = rec.mf, rec.state
    virtual, microbatches = check_options(options, pp, mf.globals, state.model, mf.path.name)
    size = options.batch_size // microbatches
    always = request.patterns or (request.fraction is not None and request.fraction < 1.0)

    forwards: dict = {}

    def programs(recompute: bool, notes: bool):
        made = pipeline_programs(
            rec,
            layout,
            Schedule(group, microbatches, options.pp_schedule, virtual, recompute),
            compute=machine.compute,
            passes=passes,
            reporting=Reporting(progress.stage, progress.note if notes else Reporting.note),
            memory_limit=request.memory_bytes,
            forwards=forwards,  # the microbatch forward, traced once for the plain and the recomputing programs
        )
        captures = {f"{PROGRAM_PREFIX}{r}": c for r, c in enumerate(made.captures)}
        return made, captures, {name: analyze(c.graph, c.slots) for name, c in captures.items()}

    made, captures, analyses = programs(bool(always), notes=True)
    if not always and any(has_checkpoint_calls(s.module.graph) for s in made.stages):
        progress.note(
            "the model's torch.utils.checkpoint calls are not recomputed one by one with pp: a pipeline recomputes whole "
            "stages, where --memory-budget (by default the device's memory), --activation-budget or the model file's recompute asks"
        )
    recompute = stage_recompute_entry(request, bool(always), None)
    budget = request.memory_bytes
    if not always and budget is not None and max(a.memory.peak for a in analyses.values()) > budget:
        # over the budget: every stage's forward again in its backward (the one recomputation pp has)
        plain = (made, captures, analyses)
        progress.total += 1 + pp  # the forward traced and each pipeline rank captured again
        made, captures, analyses = programs(True, notes=False)
        recompute = stage_recompute_entry(request, True, plain[2])
        smallest = max(a.memory.peak for a in analyses.values())
        if smallest > budget:
            if request.source != "device memory":
                raise AotError(
                    f"{request.source} {human(budget)}: with pp the smallest predicted peak is {human(min(smallest, recompute['peak_without_recompute']))} "
                    f"per rank; use more pipeline or fsdp ranks"
                )
            if recompute["peak_without_recompute"] <= smallest:  # recomputing does not help: the plain programs
                made, captures, analyses = plain
                recompute = stage_recompute_entry(request, False, None)
                smallest = max(a.memory.peak for a in analyses.values())
            recompute["fits"] = False
            recompute["warning"] = f"the predicted peak {human(smallest)} per rank exceeds the device's memory {human(budget)}" + (
                " even recomputing every stage" if recompute["policy"] == "stages" else ", and recomputing every stage would not lower it"
            )
    if recompute["policy"] == "stages":
        before = f" (predicted peak {human(recompute['peak_without_recompute'])} without)" if "peak_without_recompute" in recompute else ""
        progress.note(f"recomputing every stage's forward in its backward, as {request.source} asks{before}")
    stages, actions = made.stages, made.actions
    tied = tied_params(stages, pp)
    if tied:
        progress.note(f"tied across stages (gradients summed over the pipeline group): {', '.join(tied)}")
    peak = max(analyses, key=lambda n: analyses[n].memory.peak)
    times = {name: time_entry(machine, mesh, placement, a, options.bucket_mb) for name, a in analyses.items()}
    # the programs side by side: where each waits for another is the bubble
    timeline = simulate_pipeline([captures[f"{PROGRAM_PREFIX}{r}"].graph for r in range(pp)], Planner(machine, None), placement, group.name)
    busiest = max(range(pp), key=lambda r: timeline.busy_s[r])
    time = times[f"{PROGRAM_PREFIX}{busiest}"]
    time["predicted"] = {**time["predicted"], "step_s": timeline.step_s, "bubble_s": timeline.step_s - timeline.busy_s[busiest]}
    bubble = bubble_fraction(options.pp_schedule, pp, microbatches, virtual)
    entry = {
        "axis": PP,
        "group": group.name,
        "size": pp,
        "schedule": options.pp_schedule,
        "microbatches": microbatches,
        "microbatch_size": size,
        "stages_per_rank": virtual,
        "predicted_bubble": bubble,
        "stages": [
            {"stage": s.index, "rank": s.index % pp, "program": f"{PROGRAM_PREFIX}{s.index % pp}", "layers": s.layers, "params": s.params, "buffers": s.buffers}
            for s in stages
        ],
        "tied": tied,
        "actions": {f"{PROGRAM_PREFIX}{r}": [str(a) for a in acts] for r, acts in enumerate(actions)},
        "programs": {
            f"{PROGRAM_PREFIX}{r}": {
                "peak_bytes": analyses[f"{PROGRAM_PREFIX}{r}"].memory.peak,
                "busy_s": timeline.busy_s[r],
                "waiting_s": timeline.waiting_s[r],
            }
            for r in range(pp)
        },
        "timeline": TIMELINE_FILE,
    }
    files = {TIMELINE_FILE: (json.dumps(timeline.trace, separators=(",", ":")) + "\n").encode()}
    evaluation = eval_programs(rec, layout, made.stages, group, microbatches, progress) if options.eval else {}
    return PipelineBuild(captures, analyses[peak].memory, time, recompute, entry, lambda coords: f"{PROGRAM_PREFIX}{coords.get(PP, 0)}", files, evaluation)


EVAL_PREFIX = "eval_stage"  # + pipeline rank: its eval program's name


def eval_programs(rec: Recording, layout: StepLayout, stages: list, group, microbatches: int, progress) -> dict[str, CapturedStep]:
    """Every pipeline rank's eval program (aot/capture/eval_step.py): one microbatch's forward
    traced again with the model in eval mode and cut where the training stages were."""
    pp = group.size
    size = rec.targets.shape[0] // microbatches
    progress.total += 1
    with progress.stage(f"tracing the forward in eval mode and capturing {pp} pipeline ranks' eval programs (forward and loss)"):
        with eval_mode(rec.state.model):
            forward, sources = trace_forward(rec.mf, rec.state, layout, [t[:size] for t in rec.inputs], rec.targets[:size])
        cut_stages = cut(forward, sources, {layer: s.index for s in stages for layer in s.layers}, len(stages))
        made = {}
        for r in range(pp):
            pipeline = Pipeline(group, r, tuple(cut_stages), microbatches, ())
            captured = capture_pipeline_eval(rec.mf, rec.state, pipeline, layout, rec.inputs, rec.targets)
            captured.graph = run_passes(captured.graph, only=CLEANUP)
            made[f"{EVAL_PREFIX}{r}"] = captured
    return made
