"""`aot build`: model.py -> capture -> plan -> passes -> emit, with a progress line per stage."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from aot.capture import replicas
from aot.capture.custom_ops import custom_op_spec
from aot.capture.model_file import ModelFile, load_model_file
from aot.capture.precision import Precision, check_training_state, resolve_precision
from aot.capture.eval_step import EVAL_PROGRAM, capture_eval
from aot.capture.listed_experts import stack_experts
from aot.capture.token_bounds import token_bounds
from aot.capture.step import StepLayout
from aot.capture.sync_batchnorm import convert_to_sync, manifest_entry as batchnorm_entry
from aot.capture.training_state import TrainingState, build_training_state
from aot.emit.artifact import PROGRAM, emit_artifact, export_step
from aot.pipeline_build import EVAL_PREFIX
from aot.emit.onnx_export import CHECK_BUDGET_BYTES, ONNX_FILE, build_inference, init_program_weights
from aot.errors import AotError
from aot.compile_step import Recording, finish_program, step_layout, tensor_parallel_plan, trace_program
from aot.passes import CLEANUP, PassOptions, run_passes
from aot.defaults import DEFAULT_BUCKET_MB
from aot.plan import hierarchy
from aot.plan.cost_model import Memory
from aot.garbage_collection import collected_less_often
from aot.plan.step_reading import analyze
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh
from aot.target import Target
from aot.plan.placement import Placement, place
from aot.plan.recompute import resolve_request
from aot.plan.build_plan import time_entry
from aot.plan.search import MEMORY_HEADROOM
from aot.plan.tensor_parallel_summary import summarize
from aot.progress import Progress
from runner.execution.data import split_batch_tensors
from runner.commands.formatting import describe_batchnorm, describe_replicas, describe_time, human
from runner.format.integrity import check_writable_target
from runner.format.stacked import with_rows
from runner.hardware.nvml_probe import live_profile
from runner.hardware.topology import for_nodes, load_profile
from runner.format.axes import DATA_AXES, EP, PP, TP


@dataclass(frozen=True)
class BuildOptions:
    model_path: Path
    output: Path
    topology: str | None = None
    world_size: int = 1
    strategy: str | None = None
    batch_size: int = 8
    max_steps: int = 1000
    bucket_mb: float = DEFAULT_BUCKET_MB
    prefetch_mb: float | None = None  # fsdp: full parameters gathered ahead of use (None: one parameter)
    seed: int = 0
    nodes: int | None = None  # nodes the job spans (None: the profile's own count)
    sign_key: Path | None = None
    onnx: bool | None = None  # export the forward to ONNX: None if it can (else a warning), True or fail, False skip
    compile: str = "portable"  # "aoti": also compile each program with AOTInductor (aot/emit/aoti.py)
    sequence_parallel: bool = False  # with tp: the residual stream split along the sequence
    hierarchical: str = "auto"  # all_reduces over groups spanning nodes in two levels: auto (where cheaper), always, never
    precision: str | None = None  # fp32 | bf16 | fp16 (None: the model file's `precision`, else fp32)
    reduce_dtype: str | None = None  # gradients reduced in fp32 or the compute dtype (None: the model file's, else fp32)
    memory_budget: str | None = None  # peak per rank to fit by recomputing activations ("70GiB"; None: device memory)
    activation_budget: float | None = None  # or: the fraction of saved activation bytes kept
    activation_budget_source: str = "--activation-budget"  # or "plan": --strategy auto chose it
    microbatches: int | None = None  # pp: microbatches per step (None: as many as pipeline ranks)
    pp_schedule: str = "1f1b"  # pp: gpipe | 1f1b | interleaved-1f1b | zero-bubble (aot/plan/pipeline.py)
    stages_per_rank: int | None = None  # pp with interleaved-1f1b: model chunks per rank (None: 2)
    sync_batchnorm: bool = False  # every BatchNorm becomes SyncBatchNorm: statistics over the dp and fsdp ranks
    moe_capacity_factor: float | None = None  # ep: rows each rank sends each expert, x an even split (None: dropless)
    eval: bool = True  # also emit each rank's eval program (aot/capture/eval_step.py)


# The example batch is stored for runs without --data; past this size (a global batch of long
# sequences over many data-parallel ranks) only one rank's rows are, and every rank reads those.
MAX_EXAMPLE_BYTES = 4 * 2**20


def _stored_example(mf, batch_size: int, data_ranks: int, progress: Progress) -> dict[str, torch.Tensor]:
    """The example batch the artifact stores: the global batch (every data rank its own rows),
    or one rank's rows when the global one would be over MAX_EXAMPLE_BYTES (data files wrap, so
    every rank then reads those)."""
    one = mf.example_batch(batch_size)
    if data_ranks == 1:
        return one
    if sum(t.numel() * t.element_size() for t in one.values()) * data_ranks > MAX_EXAMPLE_BYTES:
        progress.note(
            f"example batch: one rank's {batch_size} sample(s) stored, which every data-parallel rank "
            f"reads without --data (the global batch would be over {MAX_EXAMPLE_BYTES >> 20} MiB)"
        )
        return one
    return mf.example_batch(batch_size * data_ranks)


def place_mesh(mesh: Mesh, profile: dict, planned=None, traffic: dict | None = None) -> Placement:
    """Which physical rank (torchrun's RANK, one per GPU) holds each coordinate of the mesh: the
    plan's placement for `--strategy auto`, else the cheapest `place()` finds on the profile for
    the bytes the step sends over each axis (`traffic`, as the planner places a mesh; None: each
    axis's usual traffic), the mesh's own order on a tie (so CPU profiles and profiles whose fast
    islands follow the GPU numbering keep mesh rank r on rank r)."""
    if planned is not None:
        return planned.chosen.placement.reordered(mesh.axes, mesh.shape)
    return place(Machine(profile, mesh.world_size), mesh.axes, mesh.shape, traffic)


def placed_as_planned(mesh: Mesh, profile: dict, graph: torch.fx.GraphModule, passes: PassOptions) -> tuple[Placement, str | None]:
    """(the mesh's placement, the algorithm a flat all_reduce is priced with where one may be split
    in two levels) as `aot plan` finds them for this step, so that a plan's row built by its
    --strategy runs where and as it was priced: the placement by the bytes each axis carries, the
    algorithm NCCL_ALGO pins for the step's all_reduces, read off `graph` (as traced) through
    every pass but the split in two levels (which needs the placement; the others move no bytes
    between axes). The passes run twice, on a copy for this and then for the build (about a
    second for an 8B step): the split needs the placement, the placement the bytes."""
    from aot.passes.graph_utils import copy_graph
    from aot.plan.placement import traffic_of
    from aot.plan.search import Planner
    from aot.plan.step_reading import collective_sites

    sites = collective_sites(run_passes(copy_graph(graph), passes, skip=("split_hierarchical",)))
    placement = place_mesh(mesh, profile, traffic=traffic_of(sites))
    return placement, Planner(Machine(profile, mesh.world_size), step_graph=None).flat_all_reduce_algorithm(placement, sites)


def build(options: BuildOptions, progress: Progress) -> dict:
    """Run the stages (6, plus the ONNX export unless options.onnx is False, plus the AOTInductor
    compile with options.compile == "aoti") and write the artifact: the options checked, the plan
    applied where asked (`--strategy auto`), the step compiled for the target, the artifact emitted."""
    with collected_less_often():
        return _build(options, progress)


def _build(options: BuildOptions, progress: Progress) -> dict:
    _check_options(options)
    profile = load_profile(options.topology) if options.topology else live_profile()
    profile = for_nodes(profile, options.nodes, options.world_size)
    options, planned = _apply_plan(options, profile, progress)
    mesh = Mesh.parse(options.strategy, options.world_size)
    _check_pipeline_options(options, mesh, progress)
    placement = place_mesh(mesh, profile, planned) if planned is not None else None  # else placed once traced
    compile_device = _compile_device(options, profile)
    step = compile_step(options, profile, mesh, placement, planned, progress)
    return _emit(options, profile, mesh, step.placement, planned, step, compile_device, progress)


def _check_options(options: BuildOptions) -> None:
    """Refuse, before any work, option values no build takes."""
    if options.batch_size < 1:
        raise AotError(f"--batch-size must be at least 1, got {options.batch_size}")
    if options.max_steps < 1:
        raise AotError(f"--max-steps must be at least 1, got {options.max_steps}")
    if options.moe_capacity_factor is not None and not options.moe_capacity_factor > 0:
        raise AotError(f"--moe-capacity-factor must be positive, got {options.moe_capacity_factor:g}")
    if options.bucket_mb <= 0:
        raise AotError(f"--bucket-mb must be positive, got {options.bucket_mb}")
    if options.prefetch_mb is not None and options.prefetch_mb < 0:
        raise AotError(f"--prefetch-mb must be at least 0, got {options.prefetch_mb}")
    check_writable_target(options.output, "folder")
    if options.sign_key is not None and not Path(options.sign_key).is_file():
        raise AotError(f"{options.sign_key}: no such signing key (make one with `aot keygen`)")


def _apply_plan(options: BuildOptions, profile: dict, progress: Progress):
    """(options, the plan): with `--strategy auto`, the planner's best plan (aot/plan/search.py,
    recorded by aot/plan/build_plan.py) filled into the options; else (options, None)."""
    if options.strategy != "auto":
        return options, None
    from aot.plan.build_plan import plan_for_build

    planned = plan_for_build(options, profile, progress)
    options = replace(options, strategy=planned.strategy, bucket_mb=planned.bucket_mb)
    if planned.chosen.pipeline:  # a pipeline plan: its schedule and microbatches as priced
        pipeline = planned.chosen.pipeline
        virtual = pipeline["stages_per_rank"]
        options = replace(options, microbatches=pipeline["microbatches"], pp_schedule=pipeline["schedule"], stages_per_rank=virtual if virtual > 1 else None)
        progress.note(f"pipeline as planned: --pp-schedule {pipeline['schedule']} --microbatches {pipeline['microbatches']}")
    if options.sequence_parallel and "tp=" not in planned.strategy:
        progress.note("the plan has no tp axis: --sequence-parallel does not apply")
        options = replace(options, sequence_parallel=False)
    if planned.activation_budget is not None:  # the plan fits by recomputing activations
        given = (
            "--memory-budget"
            if options.memory_budget is not None
            else "--activation-budget"
            if options.activation_budget is not None
            else "the model file's recompute"
            if planned.model_recompute
            else None
        )
        if given is None:
            options = replace(options, activation_budget=planned.activation_budget, activation_budget_source="plan")
            progress.note(
                f"recomputing activations as planned: --activation-budget {planned.activation_budget:g} (the plan does not fit device memory without)"
            )
        else:
            progress.note(f"the plan recomputes activations at --activation-budget {planned.activation_budget:g}; {given} is applied instead")
    return options, planned


def _check_pipeline_options(options: BuildOptions, mesh: Mesh, progress: Progress) -> None:
    """A pipeline's schedule, stages and microbatches refused before any tracing; pipeline options without one too."""
    if mesh.size(PP) > 1:  # refused before any tracing
        from aot.plan.pipeline import check_microbatches, chunks_of

        if mesh.axes[0] != PP:
            raise AotError(f"--strategy {options.strategy}: pp must be the first (outermost) axis, e.g. pp=2,dp=2")
        chunks_of(options.pp_schedule, options.stages_per_rank)
        check_microbatches(options.pp_schedule, mesh.size(PP), options.microbatches or mesh.size(PP), options.batch_size)
        progress.total += mesh.size(PP) - 1  # a capture per pipeline rank
    elif options.microbatches is not None or options.stages_per_rank is not None:
        raise AotError("--microbatches and --stages-per-rank split a pipeline: they need --strategy with pp=N, N > 1")
    if options.moe_capacity_factor is not None and mesh.size(EP) == 1:
        raise AotError("--moe-capacity-factor sizes expert parallelism's dispatch: it needs --strategy with ep=N, N > 1")


def _compile_device(options: BuildOptions, profile: dict):
    """The device AOTInductor compiles for (`--compile aoti`; a missing C++ compiler fails here,
    before the work), or None."""
    compile_device = None
    if options.compile == "aoti":  # a missing C++ compiler fails here, before the work
        from aot.emit.aoti import check_compiler, target_device

        compile_device = target_device(profile)
        check_compiler(compile_device)
    elif options.compile != "portable":
        raise AotError(f"--compile must be portable or aoti, got {options.compile!r}")

    return compile_device


@dataclass
class CompiledStep:
    """What compile_step makes of the model file for a target: its programs (captured, the passes
    run) and what the artifact says of them."""

    mf: ModelFile
    precision: Precision
    example: dict  # the stored example batch (every data rank's rows)
    rank_inputs: list  # one rank's inputs of it
    state: TrainingState
    batchnorm: dict | None  # the manifest's `batchnorm`
    layout: StepLayout
    captures: dict  # program name -> CapturedStep
    memory: Memory  # the busiest program's predicted memory
    time: dict  # the manifest's `time`
    recompute: dict  # the manifest's `memory.recompute`
    pipeline_entry: dict | None  # the manifest's `pipeline`
    program_of: Callable  # a rank's coordinates -> its program's name
    pipeline_files: dict  # the predicted timeline of every pipeline rank
    proof: replicas.Proof
    subgroups: dict  # hierarchical all_reduce's level groups
    evaluations: dict  # eval program name -> CapturedStep (aot/capture/eval_step.py): one, or one per pipeline rank
    placement: Placement  # which physical rank holds each coordinate of the mesh


def compile_step(options: BuildOptions, profile: dict, mesh: Mesh, placement: Placement | None, planned, progress: Progress) -> CompiledStep:
    """The model file's whole training step for the mesh: loaded, its state recorded, traced (one
    program, or one per pipeline rank), the passes run and priced (aot/compile_step.py).
    `placement` None: the mesh placed once traced, as the planner places it (placed_as_planned;
    a pipeline mesh by each axis's usual traffic)."""
    machine = Machine(profile, mesh.world_size)
    rec, target, request, example, batchnorm = _record(options, profile, mesh, machine, progress)
    layout = _layout(rec, target, progress)
    prefetch = None if options.prefetch_mb is None else int(options.prefetch_mb * 2**20)

    plain = PassOptions(bucket_bytes=int(options.bucket_mb * 2**20), prefetch_bytes=prefetch)

    def passes_for(placement: Placement, flat_algorithm: str | None) -> PassOptions:
        if not placement.identity:
            progress.note(f"placement: {describe_placement(placement)}")
        return replace(plain, hierarchical=hierarchy.chooser(machine, placement, options.hierarchical, flat_algorithm))

    pipeline_entry, program_of, pipeline_files = None, (lambda coords: PROGRAM), {}
    if target.group(PP) is not None:
        from aot.pipeline_build import build_programs

        placement = placement or place_mesh(mesh, profile)
        passes = passes_for(placement, planned.all_reduce_algorithm if planned else None)
        built = build_programs(options, rec, layout, target, (mesh, placement, machine), request, passes, progress)
        captures, memory, time, recompute = built.captures, built.memory, built.time, built.recompute
        pipeline_entry, program_of, pipeline_files = built.entry, built.program_of, built.files
        evaluations = built.evaluation
    else:
        with progress.stage(
            "capturing forward, loss, backward and optimizer as one graph" + (", and the eval program (forward and loss)" if options.eval else "")
        ):
            captured = trace_program(rec, layout)
            evaluations = {}
            if options.eval:
                evaluation = capture_eval(rec.mf, rec.state, rec.inputs, rec.targets, layout)
                evaluation.graph = run_passes(evaluation.graph, only=CLEANUP)
                evaluations = {EVAL_PROGRAM: evaluation}
        with progress.stage("running graph passes (recomputation, bucketing, hierarchical all_reduce, overlap)"):
            if placement is None:
                placement, flat_algorithm = placed_as_planned(mesh, profile, captured.graph, plain)
            else:
                flat_algorithm = planned.all_reduce_algorithm if planned else None
            passes = passes_for(placement, flat_algorithm)
            captured.graph, recompute = finish_program(captured.graph, captured.slots, request, machine.compute, passes)
            analysis = analyze(captured.graph, captured.slots)
            memory = analysis.memory
            time = time_entry(machine, mesh, placement, analysis, options.bucket_mb, recompute.get("predicted_recompute_s", 0.0))
        captures = {PROGRAM: captured}
    progress.note(describe_memory(memory, recompute))
    progress.note(describe_time(time).removeprefix("time").strip())
    if recompute.get("warning"):
        progress.warn(recompute["warning"])
    layout, proof, subgroups = _programs_read(captures, layout, profile, machine, placement, progress)
    return CompiledStep(
        rec.mf, target.precision, example, rec.inputs, rec.state, batchnorm, layout, captures, memory, time, recompute,
        pipeline_entry, program_of, pipeline_files, proof, subgroups, evaluations, placement,
    )  # fmt: skip


def _record(options: BuildOptions, profile: dict, mesh: Mesh, machine: Machine, progress: Progress):
    """(the model file recorded, the target, the recomputation asked for, the stored example batch,
    the manifest's `batchnorm`): the model file loaded, its state recorded once."""
    with progress.stage(f"loading {options.model_path.name}"):
        mf = load_model_file(options.model_path)
        precision = resolve_precision(options.precision, options.reduce_dtype, mf.globals, mf.path.name, profile)
        request = resolve_request(
            options.memory_budget, options.activation_budget, mf.globals, mf.path.name, machine.memory_bytes, MEMORY_HEADROOM, options.activation_budget_source
        )
        example = _stored_example(mf, options.batch_size, mesh.data_parallel_size, progress)
        inputs, targets = split_batch_tensors(example, "batch()")
    with progress.stage("recording how the weights are made (init program), optimizer state and learning-rate schedule"):
        state = build_training_state(mf, options.seed, options.max_steps)
        check_training_state(precision, state.params, mf.path.name)
        if options.sync_batchnorm:
            state.model = convert_to_sync(state.model, mf.path.name)
        if mesh.size(EP) > 1:  # a ModuleList's experts as one weight per parameter, which ep splits
            state = stack_experts(state, mf.path.name)
        batchnorm = batchnorm_entry(state.model, [a for a in mesh.axes if a in DATA_AXES and mesh.size(a) > 1])
    progress.note(
        f"{sum(p.numel() for p in state.params.values()):,} parameters, {state.optimizer_class}, mesh {mesh.describe()} on topology {profile['name']!r}"
    )
    if batchnorm and (batchnorm["synced"] or mesh.data_parallel_size > 1):
        progress.note(
            f"BatchNorm: {describe_batchnorm(batchnorm)}" + ("" if batchnorm["synced"] else ", as eager DDP (--sync-batchnorm: over the data-parallel ranks)")
        )
    rec = Recording(mf, state, [t[: options.batch_size] for t in inputs], targets[: options.batch_size])
    return rec, Target(mesh, precision, options.sequence_parallel, options.moe_capacity_factor), request, example, batchnorm


def _layout(rec: Recording, target: Target, progress: Progress) -> StepLayout:
    """The target's layout (aot.compile_step.step_layout), saying what tp splits and what the precision does."""
    tp = target.group(TP)
    if target.sequence_parallel and tp is None:
        raise AotError("--sequence-parallel splits the tensor-parallel group's work: it needs --strategy with tp=N, N > 1")
    plan = tensor_parallel_plan(rec, tp.size, progress.note) if tp is not None else {}
    layout = step_layout(rec, target, plan)
    if layout.sequence is not None:
        sequence = layout.sequence
        progress.note(f"sequence parallel over blocks {sequence['blocks'][0]}..{sequence['blocks'][-1]}, norms {', '.join(sequence['norms']) or 'none'}")
    precision = target.precision
    if precision.mixed:
        progress.note(
            f"precision {precision.compute}: autocast with {precision.rules}'s rules, fp32 master weights and "
            f"optimizer state, gradients reduced in {precision.reduce}" + (", dynamic loss scaling" if precision.scaler else "")
        )
    return layout


def _programs_read(captures: dict, layout: StepLayout, profile: dict, machine: Machine, placement: Placement, progress: Progress):
    """(the layout with every weight tp sums, the replicas' proof, hierarchical all_reduce's level
    groups), read from the finished programs, with a note of each."""
    proof = replicas.merged([c.replicas for c in captures.values() if c.replicas is not None])
    summed = sorted({n for c in captures.values() for n in c.tp_summed})
    if summed:
        layout = replace(layout, tp_summed=tuple(summed))
        progress.note(f"tensor parallel: {len(summed)} whole weight(s) used on each rank's own slice, gradients summed over tp: {summarize(summed)}")
    progress.note(f"replicas: {describe_replicas(proof.to_json())}")
    if layout.ep is not None:
        progress.note(describe_experts(layout, captures))
    if profile.get("device_kind") == "cuda":
        _note_math_attention(captures, progress)
    subgroups = {}
    for captured in captures.values():
        subgroups.update(level_groups(captured.graph, machine, placement))
    if subgroups:
        split = sum(1 for c in captures.values() for n in c.graph.graph.nodes if n.op == "call_function" and n.args and str(n.args[-1]).endswith(".inter"))
        progress.note(
            f"hierarchical all_reduce over {', '.join(sorted({g['axis'] for g in subgroups.values()}))}: "
            f"{split} all_reduce(s) split into a node level and a network level"
        )
    return layout, proof, subgroups


def _emit(options: BuildOptions, profile: dict, mesh: Mesh, placement: Placement, planned, step: CompiledStep, compile_device, progress: Progress) -> dict:
    """The plan's record, the exported programs, the ONNX export and AOTInductor's compile where
    asked, and the artifact written: its manifest."""
    mf, state, captures, memory, time = step.mf, step.state, step.captures, step.memory, step.time
    pipeline_entry, subgroups = step.pipeline_entry, step.subgroups
    plan_files: dict[str, bytes]
    if planned is None:
        plan_entry, plan_files = None, {}
    elif pipeline_entry is not None:
        plan_entry, plan_files = planned.finish_pipeline(memory, time, pipeline_entry["timeline"]), {}
    else:
        plan_entry, plan_files = planned.finish(captures[PROGRAM].graph, captures[PROGRAM].slots)
    if plan_entry is not None:  # the placement over the mesh as built (its axes in the strategy's order)
        plan_entry["placement"] = placement.to_json()
    with progress.stage("exporting the programs"):
        eps = {name: export_step(c) for name, c in captures.items()}
        evaluation = {name: (export_step(c), c) for name, c in step.evaluations.items()}
        graphs = [state.init_program.graph, *(ep.graph for ep in eps.values()), *(ep.graph for ep, _ in evaluation.values())]
        custom_ops = custom_op_spec(mf, graphs)  # the init program is stored too
    inference = None
    warnings: list[str] = []
    weight_bytes = sum(t.numel() * t.element_size() for t in [*state.params.values(), *state.buffers.values()])
    if options.onnx is None and weight_bytes > CHECK_BUDGET_BYTES:
        # minutes of onnxscript rewriting for a model this size, and no numeric check possible here
        progress.note(
            f"ONNX export skipped: {weight_bytes / 2**30:.1f} GiB of weights is over the {CHECK_BUDGET_BYTES >> 30} GiB "
            f"the build checks exports for (--onnx exports it unchecked; it takes minutes)"
        )
    elif options.onnx is not False:
        with progress.stage("exporting the forward to ONNX and checking it with ONNX Runtime"):
            inference = build_inference(
                mf,
                state.model,
                step.rank_inputs,
                required=options.onnx is True,
                warn=warnings.append,
                weights=_with_rows(init_program_weights(state.init_program, [*state.params, *state.buffers], options.seed), state.stacked),
            )
    for message in warnings:
        progress.warn(message)
    compiled = None
    if compile_device is not None:
        from aot.emit.aoti import compile_programs

        with progress.stage(f"compiling the program with AOTInductor for {compile_device.type} (about a minute on 2 cores)"):
            sizes = {Mesh.group_name(a): mesh.size(a) for a in mesh.axes if mesh.size(a) > 1}
            sizes.update({name: len(spec["groups"][0]) for name, spec in subgroups.items()})
            compiled = compile_programs(eps, sizes, mesh.world_size, compile_device)
    # the token ids the step can take, which the runner checks its data against (aot/capture/token_bounds.py)
    read = list(step.evaluations.values()) or list(captures.values())
    bounds = token_bounds([c.graph for c in read], [c.slots for c in read])
    with progress.stage(f"writing the artifact to {options.output}"):
        manifest = emit_artifact(
            options.output,
            programs={name: (eps[name], captures[name]) for name in captures} | evaluation,
            program_of=step.program_of,
            eval_program_of=None
            if not evaluation
            else (lambda coords: f"{EVAL_PREFIX}{coords.get(PP, 0)}")
            if pipeline_entry
            else (lambda coords: EVAL_PROGRAM),
            state=state,
            layout=step.layout,
            mesh=mesh,
            profile=profile,
            placement=placement,
            subgroups=subgroups,
            example=step.example,
            batch_size=options.batch_size,
            token_bounds=bounds,
            sign_key=options.sign_key,
            extra_files={**({ONNX_FILE: inference.data} if inference else {}), **plan_files, **step.pipeline_files, **(compiled.files if compiled else {})}
            or None,
            extra_fields={
                "precision": step.precision.to_json(),
                "memory": {"predicted": memory.itemized(), "recompute": step.recompute},
                **({"pipeline": pipeline_entry} if pipeline_entry else {}),
                **({"batchnorm": step.batchnorm} if step.batchnorm else {}),
                "replicas": step.proof.to_json(),
                "time": time,
                **({"inference": {"file": ONNX_FILE, **inference.spec}} if inference else {}),
                **({"compiled": compiled.entry} if compiled else {}),
                **({"custom_ops": custom_ops} if custom_ops else {}),
                **({"plan": plan_entry} if plan_entry else {}),
            },
            build=_build_entry(options, mf, mesh, profile),
        )
    return manifest


def _build_entry(options: BuildOptions, mf: ModelFile, mesh: Mesh, profile: dict) -> dict:
    """The manifest's `build`: the arguments the artifact was built with."""
    return {
        "model_file": mf.path.name,
        "model_sha256": mf.sha256,
        "world_size": options.world_size,
        "strategy": mesh.describe(),
        "batch_size": options.batch_size,
        "max_steps": options.max_steps,
        "bucket_mb": options.bucket_mb,
        "prefetch_mb": options.prefetch_mb,
        "hierarchical": options.hierarchical,
        "seed": options.seed,
        "topology": profile["name"],
        **({"moe_capacity_factor": options.moe_capacity_factor} if options.moe_capacity_factor is not None else {}),
    }


def level_groups(gm, machine: Machine, placement: Placement) -> dict[str, dict]:
    """The manifest's process_groups entries for the sub-groups the graph's collectives name
    ("aot.dp.intra": {"axis": DP, "level": "intra", "groups": [...]}), in physical ranks."""
    out = {}
    for node in gm.graph.nodes:
        name = str(node.args[-1]) if node.op == "call_function" and node.args else ""
        axis, _, level = name.removeprefix("aot.").partition(".")
        if name.startswith("aot.") and level in hierarchy.LEVELS and name not in out:
            out[name] = {"axis": axis, "level": level, "groups": hierarchy.group_ranks(placement, machine, name)}
    return dict(sorted(out.items()))


def _with_rows(make, stacked: dict[str, list[str]]):
    """`make` (the initial weights, made when called) with each stacked experts weight's rows also
    under the model's own names, which the ONNX export reads."""
    return (lambda: with_rows(dict(make()), stacked)) if stacked else make


def describe_experts(layout: StepLayout, captures: dict) -> str:
    """The build's line on expert parallelism: what is split, and how many rows each rank sends each expert."""
    assert layout.ep is not None  # asked only with an ep axis
    counts = sorted({layer.experts for layer in layout.ep_layers})
    rows = max(c.ep_capacity or 0 for c in captures.values())  # 0: not recorded (a pipeline's stages)
    factor = layout.ep_capacity_factor
    how = "dropless" if factor is None else f"--moe-capacity-factor {factor:g}: choices past it are dropped and counted"
    if any(layer.listed for layer in layout.ep_layers):  # a ModuleList's experts: stacked, the block's own dispatch
        how, rows = "each block's own dispatch buffer and capacity; the ModuleList's weights stacked, one [E, ...] per parameter", 0
    return (
        f"expert parallel over {layout.ep.size} ranks: {len(layout.ep_layers)} experts layer(s) of {'/'.join(map(str, counts))}, "
        f"{counts[0] // layout.ep.size} per rank; tokens dispatched by all_to_all, " + (f"{rows} rows per expert and rank ({how})" if rows else how)
    )


def describe_memory(memory, recompute: dict) -> str:
    """One line: the predicted peak per rank, itemized, and what was recomputed."""
    parts = memory.itemized()
    line = (
        f"predicted peak {human(parts['peak'])} per rank: parameters {human(parts['resident']['params'])}, "
        f"optimizer state {human(parts['resident']['optimizer'])}, at the peak "
        + ", ".join(f"{name.replace('_', ' ')} {human(n)}" for name, n in parts["at_peak"].items() if n)
    )
    if recompute.get("recomputed_values"):
        line += (
            f"; recomputing {recompute['recomputed_values']} saved value(s) in backward "
            f"({recompute['recomputed_ops']} ops): saved activations {human(recompute['saved_activation_bytes'])} -> "
            f"{human(recompute['kept_activation_bytes'])}"
        )
    return line


def describe_placement(placement: Placement) -> str:
    """One line: each axis's groups of physical ranks, innermost axis first."""
    size = dict(zip(placement.axes, placement.shape))
    parts = []
    for axis in reversed(placement.order):
        if size[axis] > 1:
            groups = placement.groups(axis)
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:4]) + (" ..." if len(groups) > 4 else "")
            parts.append(f"{axis} groups {shown}")
    return "; ".join(parts)


def _note_math_attention(captures: dict, progress) -> None:
    """Say where a GPU artifact's attention keeps its scores (aot/capture/target_autocast.py): the
    predictions include them; eager PyTorch on the GPU would run flash attention."""
    from aot.capture.target_autocast import math_attention

    calls, size, shape = max((math_attention(c.graph.graph) for c in captures.values()), key=lambda x: x[1])
    if calls:
        progress.note(
            f"attention: {calls} scaled_dot_product_attention call(s) recorded as torch's math decomposition, "
            f"scores {'x'.join(map(str, shape or ()))} ({human(size)} per step on the busiest rank) computed and kept "
            f"for backward, which the predictions include; a GPU's eager PyTorch runs flash attention, which keeps none "
            f"(aot records attention as its fused operator only without dropout and outside tensor parallelism)"
        )
