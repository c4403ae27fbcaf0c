"""What `aot build` records of the planner: the manifest's `time` entry of every build, and for
`--strategy auto` the plan it chose (BuildPlan, plan_for_build) with its `plan` entry and predicted
timeline, priced on the program as built. The search itself is aot.plan.search."""

from __future__ import annotations

from dataclasses import dataclass

from aot.errors import AotError
from aot.plan.cost_model import StepGraph
from aot.plan.step_reading import analyze
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh
from aot.plan.placement import Placement
from aot.plan.search import TIMELINE_FILE, Plan, Planner, plan_model


def time_entry(machine: Machine, mesh: Mesh, placement: Placement, built: StepGraph, bucket_mb: float, recompute_s: float = 0.0) -> dict:
    """The manifest's `time` entry of every build: the cost model's step time for the program
    exactly as built (its buckets, overlap and recomputation) on the profile it was built for,
    which `aot inspect --profile` sets beside a measurement."""
    planner = Planner(machine, step_graph=None)
    plan = planner.evaluate(mesh.axes, mesh.shape, bucket_mb, step=built, bucketed=True, placement=placement, as_built=True)
    p = plan.prediction
    return {
        "predicted": {"step_s": p.step_s, "compute_s": p.compute_s, "comm_s": p.comm_s, "exposed_comm_s": p.exposed_comm_s, "recompute_s": recompute_s},
        "topology": machine.name,
        "calibrated": bool(machine.calibration) or machine.compute.calibrated,
        "overlap": planner.overlaps,
    }


def manifest_entry(planner: Planner, chosen: Plan, graph, slots, ranked: list[Plan], batch_size: int) -> tuple[dict, dict[str, bytes]]:
    """The manifest's `plan` entry and the files it names (the predicted timeline), priced on the
    graph exactly as built (after bucketing and overlap)."""
    import json

    from aot.plan.timeline import chrome_trace

    built = analyze(graph, slots)
    final = planner.evaluate(chosen.axes, chosen.shape, chosen.bucket_mb, step=built, bucketed=True, placement=chosen.placement, trace=True, as_built=True)
    machine = planner.machine
    trace = chrome_trace(final.prediction, title=f"{chosen.strategy}, bucket {chosen.bucket_mb:g} MiB on {machine.describe()}")
    predicted = {**final.prediction.to_json(), "fits": final.fits, "device_memory_bytes": machine.memory_bytes}
    entry = _entry(planner, chosen, predicted, final.nccl_algo, ranked, batch_size, TIMELINE_FILE)
    data = (json.dumps(trace, separators=(",", ":")) + "\n").encode()
    return entry, {TIMELINE_FILE: data}


def pipeline_manifest_entry(planner: Planner, chosen: Plan, memory, time: dict, ranked: list[Plan], batch_size: int, timeline: str) -> dict:
    """The manifest's `plan` entry of a pipeline plan: the build's own prediction of its programs
    as built (the pipeline simulation, aot/pipeline_build.py) and its timeline file."""
    predicted = {**time["predicted"], "memory_bytes": memory.to_json(), "fits": chosen.fits, "device_memory_bytes": planner.machine.memory_bytes}
    return _entry(planner, chosen, predicted, chosen.nccl_algo, ranked, batch_size, timeline)


def _entry(planner: Planner, chosen: Plan, predicted: dict, nccl_algo, ranked: list[Plan], batch_size: int, timeline: str) -> dict:
    machine = planner.machine
    entry = {
        "source": "aot build --strategy auto",
        "strategy": chosen.strategy,
        "bucket_mb": chosen.bucket_mb,
        "batch_size": batch_size,
        "topology": machine.name,
        "calibrated": bool(machine.calibration) or machine.compute.calibrated,
        "overlap": planner.overlaps,
        "placement": chosen.placement.to_json(),
        "nccl_algo": nccl_algo,
        "predicted": predicted,
        "candidates": [
            {
                "strategy": p.strategy,
                "bucket_mb": p.bucket_mb,
                "step_s": p.prediction.step_s,
                "data_ranks": p.data_ranks,
                "peak_memory_bytes": p.prediction.memory.peak,
                "collectives_per_step": p.prediction.collectives,
                "fits": p.fits,
                **({"recompute": p.recompute} if p.recompute is not None else {}),
                **({"pipeline": p.pipeline} if p.pipeline else {}),
            }
            for p in ranked[:16]
        ],
        "timeline": timeline,
    }
    if chosen.pipeline:
        entry["pipeline"] = chosen.pipeline
    if chosen.recompute is not None:  # the activation budget the plan was priced at, which the build applied
        entry["recompute"] = chosen.recompute
    return entry


@dataclass
class BuildPlan:
    """The plan `aot build --strategy auto` builds, and how to describe it in the artifact."""

    planner: Planner
    chosen: Plan
    ranked: list[Plan]
    batch_size: int
    model_recompute: bool = False  # the model file names its own `recompute` policy

    @property
    def strategy(self) -> str:
        return self.chosen.strategy

    @property
    def activation_budget(self) -> float | None:
        """The activation budget the chosen plan recomputes at (None: it recomputes nothing)."""
        return self.chosen.recompute

    @property
    def bucket_mb(self) -> float:
        return self.chosen.bucket_mb

    @property
    def all_reduce_algorithm(self) -> str | None:
        """The algorithm the planner's split of all_reduces in two levels priced the flat ones with
        (None: none split), which the build's hierarchical choice prices them with, as the planner did."""
        return self.chosen.split_flat_algorithm

    def finish(self, graph, slots) -> tuple[dict, dict[str, bytes]]:
        return manifest_entry(self.planner, self.chosen, graph, slots, self.ranked, self.batch_size)

    def finish_pipeline(self, memory, time: dict, timeline: str) -> dict:
        return pipeline_manifest_entry(self.planner, self.chosen, memory, time, self.ranked, self.batch_size, timeline)


def plan_for_build(options, profile: dict, progress) -> BuildPlan:
    """Search plans for a build's model, world size and batch size; the best that fits, with the
    placement it was priced with (`chosen.placement`), which the build applies."""
    progress.total += 1
    with progress.stage(f"planning: pricing strategies and bucket sizes on topology {profile['name']!r}"):
        plans, skipped, planner, steps = plan_model(
            options.model_path,
            profile,
            options.world_size,
            options.batch_size,
            seed=options.seed,
            sequence_parallel=options.sequence_parallel,
            hierarchical=options.hierarchical,
            precision=options.precision,
            reduce_dtype=options.reduce_dtype,
            moe_capacity_factor=options.moe_capacity_factor,
        )
        chosen = best_plan(plans)
    p = chosen.prediction
    recompute = f" --activation-budget {chosen.recompute:g}" if chosen.recompute is not None else ""
    progress.note(
        f"plan: --strategy {chosen.strategy} --bucket-mb {chosen.bucket_mb:g}{recompute}, predicted "
        f"{p.step_s * 1e3:.3g} ms per step, {p.memory.peak / 2**20:.1f} MiB per rank (best of {len(plans)} candidates)"
    )
    return BuildPlan(planner, chosen, plans, options.batch_size, model_recompute=steps.mf.globals.get("recompute") is not None)


def best_plan(plans: list[Plan]) -> Plan:
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: p.prediction.memory.peak) if plans else None
        from runner.commands.formatting import human

        need = (
            (
                f" (the smallest needs {human(smallest.prediction.memory.peak)} per rank"
                + (", recomputing activations" if smallest.recompute is not None else "")
                + ")"
            )
            if smallest
            else ""
        )
        raise AotError(f"no plan fits the device memory{need}")
    return fitting[0]
