"""The one compile path: a model file's whole training step for a target, traced and through the
graph passes. The build (aot/build.py), the pipeline build (aot/pipeline_build.py) and the
planner's pricing (aot/plan/model_steps.py) all make their programs with these functions, so the
planner prices the program the build makes (tests/test_compile_path.py compares them node for node).

    Recording          the model file loaded and recorded once: module, training state, one rank's batch
    tensor_parallel_plan   the layers tp splits at a degree (the model file's tp_plan, or found)
    step_layout        the target (aot/target.py) as the traced step sees it (aot.capture.step.StepLayout)
    trace_program      the step traced (make_fx) and cleaned up (aot.passes.CLEANUP)
    finish_program     recomputation as requested, then the rest of aot.passes.PASSES

A pipeline's programs are made by aot.plan.pipeline_programs from the same layout and pass options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aot.capture.expert_parallel import check_expert_parallel
from aot.capture.model_file import ModelFile
from aot.capture.step import CapturedStep, StepLayout, capture_step
from aot.capture.training_state import TrainingState
from aot.errors import AotError
from aot.passes import CLEANUP, PassOptions, run_passes
from aot.plan.recompute import Request, apply_request
from aot.plan.sequence_parallel import check_sequence_length, sequence_parallel_layout
from aot.plan.tensor_parallel import Finding, check_degree, check_divisible, explain_plan, summed_params, user_plan
from aot.plan.tensor_parallel_summary import summarize, summarize_whole, unsplit_weights
from aot.plan.tensor_parallel_trial import split_forward_failure
from aot.target import Target
from runner.format.axes import DP, EP, FSDP, TP
from runner.commands.formatting import tp_layer


@dataclass
class Recording:
    """A model file loaded and recorded once for every program compiled from it: its training
    state (the weights' init program, optimizer, schedule) and one data-parallel rank's batch."""

    mf: ModelFile
    state: TrainingState
    inputs: list[torch.Tensor]
    targets: torch.Tensor


def tensor_parallel_plan(rec: Recording, tp: int, note: Callable[[str], None] | None = None, read: Callable[[], Finding] | None = None) -> dict[str, str]:
    """The layers tensor parallelism splits at degree `tp`: the model file's tp_plan, or the
    column/row-wise pairs found in its forward (aot.plan.tensor_parallel), each run split at this
    degree. `note(line)` hears which layers it splits and which it leaves whole, and why.
    `read()`: the pairs read from the forward where the caller keeps them for every degree
    (aot.plan.tensor_parallel.read_plan of `rec`)."""
    mf, model = rec.mf, rec.state.model
    check_degree(mf, model, tp)
    plan = user_plan(mf, model)
    where, whole, found = f"tp_plan in {mf.path.name}", {}, None
    if plan is None:
        found = explain_plan(model, rec.inputs, tp, read() if read is not None else None)
        plan, whole, where = found.plan, found.whole, "the found plan"
        if not plan:
            reasons = "; ".join(summarize_whole(whole)[:3])
            raise AotError(
                f"--strategy tp={tp}: no Linear pair in {mf.path.name} can be split ({reasons}); name the layers in a tp_plan (see README: Strategies)"
            )
    check_divisible(plan, model, tp, where)
    if found is None:  # the found plan was run split already
        failure = split_forward_failure(model, plan, rec.inputs, tp)
        if failure is not None:
            raise AotError(f"{where}: {failure[0]} cannot be split as planned: {failure[1]}; or leave its layers out of tp_plan")
    if note is not None:
        cols = [tp_layer(n, s) for n, s in plan.items() if s != "rowwise"]
        rows = [n for n, s in plan.items() if s == "rowwise"]
        note(f"tensor parallel over {tp} ranks: {len(cols)} column-wise ({summarize(cols)}), {len(rows)} row-wise ({summarize(rows)})")
        for line in summarize_whole(whole) + unsplit_weights(model, {**plan, **whole}):
            note(f"  left whole: {line}")
    return plan


def step_layout(rec: Recording, target: Target, tp_plan: dict[str, str]) -> StepLayout:
    """The target as the traced step sees it: its data-parallel, fsdp and tp groups, the tp plan
    (`tensor_parallel_plan` at the target's degree; {} without tp), the sequence-parallel blocks
    where asked, the precision. Refuses (AotError) a sequence tp cannot split."""
    tp = target.group(TP)
    sequence = None
    if target.sequence_parallel and tp is not None:
        sequence = sequence_parallel_layout(rec.state.model, tp_plan, "the plan")
        check_sequence_length(rec.state.model, rec.inputs, sequence["blocks"][0], tp.size)
    ep = target.group(EP)
    return StepLayout(
        target.group(DP),
        target.group(FSDP),
        tp,
        tuple(sorted(tp_plan.items())),
        sequence,
        target.precision,
        tp_summed=summed_params(rec.mf, rec.state.model) if tp is not None else (),
        ep=ep,
        ep_layers=check_expert_parallel(rec.state.model, ep.size, rec.mf.path.name, target.moe_capacity_factor) if ep is not None else (),
        ep_capacity_factor=target.moe_capacity_factor,
    )


def trace_program(rec: Recording, layout: StepLayout, for_pricing: bool = False) -> CapturedStep:
    """The step of one rank of `layout` as one graph, cleaned up (aot.passes.CLEANUP) so it can be
    read, priced and derived from. `for_pricing`: make_fx's graph without its Python code
    (aot.plan.pricing.trace_for_pricing), traced once however many tp ranks (the build traces the
    first and last and refuses a difference)."""
    from aot.plan.pricing import trace_for_pricing

    tracer = trace_for_pricing if for_pricing else None
    captured = capture_step(rec.mf, rec.state, rec.inputs, rec.targets, layout, check_ranks=not for_pricing, tracer=tracer)
    captured.graph = run_passes(captured.graph, only=CLEANUP)
    return captured


def finish_program(gm: torch.fx.GraphModule, slots: list, request: Request, compute, passes: PassOptions, skip: tuple[str, ...] = ()):
    """(graph module, what was recomputed: the manifest's `memory.recompute`): the traced
    program's recomputation as `request` asks (aot.plan.recompute.apply_request, priced on
    `compute`), then the passes after the cleanup but those in `skip` (the planner skips what it
    prices analytically, aot.passes.PRICED_ANALYTICALLY). `gm` is changed in place."""
    finish = lambda g: run_passes(g, passes, skip=(*CLEANUP, *skip))  # noqa: E731
    return apply_request(gm, slots, request, compute, finish)
