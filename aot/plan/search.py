"""Strategy search: enumerate plans, predict each one's step time and memory, rank them.

A plan is a mesh (degrees of the axes the build supports, aot.plan.mesh.SUPPORTED_AXES), a
gradient bucket size, and a placement of the mesh on the machine. The model is traced once per
tensor-parallel degree, whatever the world size (aot/plan/model_steps.py: dp x fsdp=2, from which every other
fsdp degree is derived, and dp alone, whose forward and backward are that trace's with the step's
end traced alone); bucket sizes are applied analytically
(aot.plan.rebucket) and every candidate is priced by cost_model.simulate, so a search over 1024
GPUs costs a handful of traces.

Plans whose predicted peak memory per rank exceeds MEMORY_HEADROOM of the device's memory are kept
in the table but marked as not fitting and never chosen. Each such plan is also priced recomputing
activations (`Plan.recompute`: the activation budget, aot.passes.recompute.by_budget, that
`aot build --activation-budget` applies): its graph with the recomputation in it, so its step time
includes the extra ops and its peak the activations no longer kept; the variant that fits and is
fastest (else the one with the lowest peak) is a candidate of its own. Ranking: plans that fit
first, then predicted time per sample (`--batch-size` is per data-parallel rank), then memory,
then the fewest collectives. Pipeline meshes are priced by tracing every pipeline rank's program
at each schedule, so a default search prices them only where nothing without pp fits, or where
they could both fit (pipeline_cannot_fit: the gradients a pipeline rank sums whole) and rank
first (pipeline_may_win: a lower bound on time per sample): aot/plan/pipeline_search.py. Plans
and their ranking: aot/plan/plans.py.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from aot.errors import AotError
from aot.plan import collectives, hierarchy
from aot.plan.class_floor import CannotWin, ClassBound
from aot.plan.cost_model import StepGraph, op_seconds, op_time, simulate, step_floor
from aot.plan.rebucket import rebucket
from aot.plan.hierarchical_split import split_levels
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh, factorizations
from aot.plan.model_steps import ModelSteps, Pricing, Unsupported
from aot.plan.pipeline_search import PipelineSearch
from aot.plan.placement import Placement, place, traffic_of
from aot.plan.plans import MEMORY_HEADROOM, Plan, mesh_name, per_sample_s, rank_key
from aot.defaults import DEFAULT_BUCKET_MB
from runner.format.axes import DP, EP, PP

__all__ = ["MEMORY_HEADROOM", "MemoryLimit", "Plan", "Planner", "per_sample_s", "plan_model", "rank_key"]

BUCKET_MB_CANDIDATES = (1.0, 4.0, DEFAULT_BUCKET_MB, 100.0)
TIMELINE_FILE = "plan/timeline.json"
MiB = 2**20


class Planner(PipelineSearch):
    """Prices plans for one machine. `step_graph(axes, shape)` gives the unbucketed step graph of
    one rank for a mesh (raising Unsupported when the build cannot trace it); without it the
    planner prices only graphs it is given (`evaluate(step=...)`)."""

    def __init__(
        self,
        machine: Machine,
        step_graph: Callable[[tuple, tuple], StepGraph] | None,
        hierarchical: str = "auto",
        recomputing: Callable[[tuple, tuple], list[tuple[float, StepGraph]]] | None = None,
        pipeline: Callable | None = None,
        batch_size: int | None = None,
        pipeline_holdings: Callable | None = None,
        note: Callable[[str], None] | None = None,
        bound: ClassBound | None = None,
    ):
        self.machine = machine
        self.bound = bound  # layout classes that cannot rank first, left unpriced (aot.plan.class_floor)
        self.note = note or (lambda line: None)  # hears the search's progress (`aot plan` on a terminal)
        self.batch_size = batch_size  # per data-parallel rank: the microbatch counts a pipeline can take (None: any)
        # (axes, shape, microbatches) -> (programs, their analyses), one per pipeline rank (ModelSteps.pipeline)
        self._pipeline = pipeline
        # (fsdp, tp, ep) -> what a pipeline mesh's ranks hold at the least (ModelSteps.pipeline_holdings)
        self._pipeline_holdings = pipeline_holdings
        self._work, self._work_seconds = None, {}  # the data-parallel graph the pipelines' time bounds read (pipeline_work)
        self.hierarchical = hierarchical  # all_reduces in two levels: "auto" (where cheaper), "always", "never"
        self._step_graph = step_graph
        # (axes, shape) -> [(activation budget, the mesh's graph recomputing at it)] (ModelSteps.recomputing)
        self._recomputing = recomputing
        self._graphs: dict = {}
        self._op_times: dict = {}
        # a search prices every bucket size of a mesh on the same placement: the spans of its
        # groups (which walk every rank) are found once per placement
        self._spans: dict = {}
        self._choosers: dict = {}  # (placement, mode, flat algorithm) -> hierarchy.chooser's
        self.pipelines_apart_s = 0.0  # seconds pipeline meshes were priced in worker processes (_pipelines_ahead)

    def step_graph(self, axes, shape) -> StepGraph:
        key = tuple((a, d > 1 if a == DP else d) for a, d in zip(axes, shape))
        if key not in self._graphs:
            assert self._step_graph is not None, "this planner prices given graphs only"
            self._graphs[key] = self._step_graph(tuple(axes), tuple(shape))
        return self._graphs[key]

    def _op_times_for(self, step: StepGraph) -> list[float]:
        """op_seconds(step), once per graph; a graph resized from another (rescale) prices only
        the ops it replaced."""
        key = id(step.ops)
        if key not in self._op_times:
            if step.resized_from is not None:
                base, replaced = step.resized_from
                times = list(self._op_times_for(base))
                for i in replaced:
                    times[i] = op_time(step.ops[i], self.machine.compute)
            else:
                times = op_seconds(step, self.machine.compute)
            self._op_times[key] = (step.ops, times)
        return self._op_times[key][1]

    # -- collectives ------------------------------------------------------------------------
    def comm_pricer(self, placement: Placement, comms: list, kinds: tuple[str, ...] = collectives.KINDS) -> tuple[Callable, str | None]:
        """(site -> (algorithm, seconds), NCCL_ALGO setting) for a step's collectives `comms`. The groups of one axis run at once,
        so a collective costs what it costs on the slowest of them. NCCL's algorithm is set per
        collective kind for the whole run (NCCL_ALGO), so each kind gets the one algorithm that
        makes that kind's collectives cheapest in sum; other backends run what they implement. A
        hierarchical all_reduce is priced as its three collectives (aot.plan.hierarchical_split).
        `kinds`: the kinds to pin (the others run their first algorithm)."""
        machine = self.machine
        realizable = collectives.REALIZABLE.get(machine.backend, collectives.REALIZABLE["gloo"])
        spans = self._spans

        def spans_of(group: str, kind: str):
            key = (placement, group, kind)
            if key not in spans:
                axis = Mesh.axis_of(group)
                if axis in placement.axes:
                    groups = placement.distinct_groups(axis, machine.per_node)
                    spans[key] = hierarchy.distinct_spans(machine, groups, kind)
                else:  # a level of a hierarchical all_reduce ("aot.dp.intra")
                    try:
                        spans[key] = hierarchy.level_spans(machine, placement, group, kind)
                    except ValueError as e:
                        raise AotError(f"the step's collective names group {group!r}: {e}") from None
            return spans[key]

        def seconds(kind: str, group: str, nbytes: int, algorithm: str) -> float:
            kind = kind if kind in collectives.ALGORITHMS else "all_reduce"
            return max(machine.compute.collective_seconds(kind, algorithm, s, nbytes) for s in spans_of(group, kind))

        def price(site, algorithm: str) -> float:
            return seconds(site.kind, site.group, site.bytes, algorithm)

        pinned: dict[str, str] = {}
        # a deep step repeats each block's collectives: each (group, size) of a kind priced once
        counted = Counter((c.kind, c.group, c.bytes) for c in comms)
        by_kind: dict[str, dict[tuple, int]] = {}
        for (kind, group, nbytes), n in counted.items():
            by_kind.setdefault(kind, {})[(group, nbytes)] = n
        for kind in collectives.KINDS:
            sites = by_kind.get(kind, {})
            options = realizable.get(kind, ("ring",))
            if not sites or len(options) == 1 or kind not in kinds:
                pinned[kind] = options[0]
                continue
            totals = [(math.fsum(n * seconds(kind, g, b, a) for (g, b), n in sites.items()), i, a) for i, a in enumerate(options)]
            pinned[kind] = min(totals)[2]
        nccl = None
        if machine.backend == "nccl" and comms:
            names = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter"}
            used = sorted(k for k in by_kind if k in names)
            nccl = ";".join(f"{names[k]}:{_nccl_name(pinned[k])}" for k in used)

        cache: dict = {}

        def cost(site):
            kind = site.kind if site.kind in collectives.ALGORITHMS else "all_reduce"
            key = (site.group, kind, site.bytes)
            if key not in cache:
                algorithm = pinned.get(kind, "ring")
                cache[key] = (algorithm, price(site, algorithm))
            return cache[key]

        return cost, nccl

    # -- one plan ---------------------------------------------------------------------------
    def evaluate(
        self,
        axes,
        shape,
        bucket_mb: float,
        *,
        step: StepGraph | None = None,
        bucketed: bool = False,
        placement: Placement | None = None,
        trace: bool = False,
        as_built: bool = False,
    ) -> Plan:
        """Price one plan. `as_built`: the graph is the build's, whose all_reduces were already
        split where hierarchical pays (aot/passes/hierarchical.py): price them as they are."""
        base = step if step is not None else self.step_graph(axes, shape)
        graph = base if bucketed else rebucket(base, int(bucket_mb * MiB))
        if placement is None:
            placement = place(self.machine, tuple(axes), tuple(shape), traffic_of(graph.comms))
        flat_algorithm = None
        if not as_built:  # the all_reduces split in two levels as the build's pass will split them
            graph, flat_algorithm = self._split_levels(graph, placement)
        cost, nccl = self.comm_pricer(placement, graph.comms)
        times = self._op_times_for(base)
        prediction = simulate(graph, self.machine.compute, cost, overlap=self.overlaps, trace=trace, op_times=times)
        return Plan(tuple(axes), tuple(shape), bucket_mb, placement, prediction, self.fits(prediction.memory.peak), nccl, split_flat_algorithm=flat_algorithm)

    def _split_levels(self, graph: StepGraph, placement: Placement) -> tuple[StepGraph, str | None]:
        """(`graph` with the all_reduces aot.passes.hierarchical splits on this placement split,
        the all_reduce algorithm the choice priced the flat ones with): hierarchy.chooser's choice,
        the flat all_reduce at the algorithm NCCL_ALGO pins for the unsplit graph's all_reduces,
        which `--strategy auto` hands the build's chooser (BuildPlan.all_reduce_algorithm)."""
        flat = self.flat_all_reduce_algorithm(placement, graph.comms) if self.hierarchical != "never" else None
        if flat is None:
            return graph, None
        key = (placement, self.hierarchical, flat)
        if key not in self._choosers:  # every bucket size of a mesh is split on the same placement
            self._choosers[key] = hierarchy.chooser(self.machine, placement, self.hierarchical, flat)
        return split_levels(graph, self._choosers[key]), flat

    def flat_all_reduce_algorithm(self, placement: Placement, comms: list) -> str | None:
        """The algorithm NCCL_ALGO pins for the all_reduces of `comms` (a step's collectives, its
        buckets packed, none split): what a flat all_reduce is priced with where the planner and
        the build choose which to split in two levels. None: no all_reduce."""
        reduces = [c for c in comms if c.kind == "all_reduce"]
        if not reduces:
            return None
        cost, _ = self.comm_pricer(placement, reduces, kinds=("all_reduce",))
        return cost(reduces[0])[0]

    @property
    def overlaps(self) -> bool:
        """Whether communication runs beside compute (the device model's say). GPUs: yes (NCCL
        kernels on their own stream). CPU ranks with gloo: its threads copy and reduce on the cores
        the ranks compute on, so the model counts communication as not overlapping."""
        return self.machine.compute.overlaps_communication

    # -- the search ---------------------------------------------------------------------------
    def search(
        self,
        axes: tuple[str, ...],
        bucket_mbs: tuple[float, ...] | None = None,
        prune_pipelines: bool = False,
        workers: int = 1,
        priced: dict[tuple, tuple[list[Plan], list[str]]] | None = None,
    ) -> tuple[list[Plan], list[str]]:
        """Every mesh over `axes` for the machine's world size x every distinct bucketing, ranked.
        `prune_pipelines`: price a pipeline mesh only where it could rank first (pipeline_may_win)
        or where nothing without pp fits; its every pipeline rank's program is traced at each
        schedule, ten times a mesh without pp. `workers`: processes that price pipeline meshes at
        once (`_pipelines_ahead`). `priced`: meshes without pp priced already (`priced`'s, as
        their graphs were traced: aot.plan.layout_traces.prefetch)."""
        plans, skipped = [], []
        pipelines = [shape for shape in factorizations(self.machine.world_size, axes) if dict(zip(axes, shape)).get(PP, 1) > 1]
        meshes = [shape for shape in factorizations(self.machine.world_size, axes) if shape not in pipelines]
        for made, missed in self._meshes_priced(axes, meshes, bucket_mbs, workers, priced or {}):
            plans += made
            skipped += missed
        if self.bound is not None:
            plans, left_out = self.bound.unpriced(plans, meshes, axes)
            skipped += left_out
        seeds = self.pipeline_seeds(axes, plans) if prune_pipelines else None
        if pipelines:
            self.pipeline_work(plans)  # each pipeline configuration's time bound reads it (pipeline_plan)
        ahead: dict[tuple, Plan | Unsupported] = {}  # pipeline meshes priced in workers, one pp degree at a time
        unpriced: dict[tuple[int, str], int] = {}
        too_deep = None  # the fewest stages the model has too few layers for
        by_degree: dict[int, list[tuple]] = {}
        for shape in sorted(pipelines, key=lambda s: dict(zip(axes, s))[PP]):
            by_degree.setdefault(dict(zip(axes, shape))[PP], []).append(shape)
        for shape in [s for degree in by_degree.values() for s in degree]:
            pp = dict(zip(axes, shape))[PP]
            if shape == by_degree[pp][0] and (too_deep is None or pp < too_deep[0]):  # the first of this degree's meshes
                ahead = self._pipelines_ahead(axes, by_degree[pp], plans, seeds, workers)
            why = None
            if too_deep is not None and pp >= too_deep[0]:
                why = too_deep[1]
            elif seeds is not None:
                why = self.unpriced_pipeline(axes, shape, plans, seeds)
            if why is not None:
                unpriced[(pp, why)] = unpriced.get((pp, why), 0) + 1
                continue
            try:
                outcome = ahead[shape] if shape in ahead else self.pipeline_plan(axes, shape)
                if isinstance(outcome, Unsupported):
                    raise outcome
                plans.append(outcome)
            except Unsupported as e:
                skipped.append(f"{mesh_name(axes, shape)}: {e}")
                if "need at least" in str(e) and "layers" in str(e):  # more stages than layers: deeper pipelines too
                    too_deep = (pp, f"more stages than the model has layers (pp={pp} already)")
        for (pp, why), count in unpriced.items():
            hint = " (--axes dp,fsdp,tp,pp prices them all)" if seeds is not None and "layers" not in why else ""
            skipped.append(f"pp={pp} ({count} mesh{'es' if count > 1 else ''}): not priced, {why}{hint}")
        plans.sort(key=rank_key)
        return plans, skipped

    def priced(self, axes: tuple, bucket_mbs) -> Callable[[list[tuple]], dict[tuple, tuple[list[Plan], list[str]]]]:
        """meshes -> {mesh: its (plans, skipped)} (`_mesh_priced`), for the meshes without pp of a
        search over `axes` that are priced as their graphs are traced (`search`'s `priced`)."""

        def priced(meshes: list[tuple]) -> dict:
            made = {shape: self._mesh_priced(axes, shape, bucket_mbs) for shape in meshes}
            if self.bound is not None:  # the classes traced after these are judged against them
                self.bound.publish(made)
            return made

        return priced

    def _meshes_priced(self, axes: tuple, meshes: list[tuple], bucket_mbs, workers: int, priced: dict) -> list[tuple[list[Plan], list[str]]]:
        """[(plans, skipped)] of each mesh without pp (`_mesh_priced`), in order, but those in
        `priced` already; by `workers` forked processes at once, each taking the meshes read from
        one graph (those that differ in their dp degree only: the graph's derivations and op times
        are made once), where there is more than one such group (aot.plan.workers)."""
        from aot.plan.workers import in_workers

        groups: dict[tuple, list[tuple]] = {}
        for shape in meshes:
            if shape not in priced:
                groups.setdefault(tuple((a, d > 1 if a == DP else d) for a, d in zip(axes, shape)), []).append(shape)
        jobs = list(groups.values())
        before = {id(group): sum(len(g) for g in jobs[:i]) for i, group in enumerate(jobs)}  # meshes in the groups before each
        quarters = {before[id(jobs[len(jobs) * q // 4])] for q in range(1, 4)} if jobs else set()
        left = sum(len(group) for group in jobs)

        def started(group: list[tuple]) -> None:  # a line as the search starts, then at each quarter of it
            if not before[id(group)]:
                count = f"{left} mesh{'es' if left != 1 else ''}"
                self.note(f"pricing {count} without pp, each at every bucket size (recomputing activations where over device memory)")
            elif before[id(group)] in quarters:
                self.note(f"pricing mesh {before[id(group)] + 1} of {left} ({mesh_name(axes, group[0])})")

        made = in_workers(jobs, lambda group: [self._mesh_priced(axes, shape, bucket_mbs) for shape in group], workers, started=started)
        by_mesh = {**priced, **{shape: one for group, ones in zip(groups.values(), made) for shape, one in zip(group, ones)}}
        return [by_mesh[shape] for shape in meshes]

    def _mesh_priced(self, axes: tuple, shape: tuple, bucket_mbs) -> tuple[list[Plan], list[str]]:
        """(plans, skipped) of one mesh without pp: a plan per distinct bucketing, and where one does
        not fit, the plans recomputing activations."""
        plans: list[Plan] = []
        try:
            step = self.step_graph(axes, shape)
        except CannotWin:
            return [], []  # its class is listed once, with why (`search`)
        except Unsupported as e:
            return [], [f"{mesh_name(axes, shape)}: {e}"]
        placement = None
        seen: dict[tuple, Plan] = {}
        for mb in _bucket_candidates(step, bucket_mbs):
            graph = rebucket(step, int(mb * MiB))
            signature = tuple((c.kind, c.group, c.bytes, c.issue_at, c.wait_at) for c in graph.comms)
            if signature in seen:  # same buckets as a size already priced: the same plan
                if abs(mb - DEFAULT_BUCKET_MB) < abs(seen[signature].bucket_mb - DEFAULT_BUCKET_MB):
                    seen[signature].bucket_mb = mb
                continue
            if placement is None:
                placement = place(self.machine, tuple(axes), tuple(shape), traffic_of(graph.comms))
            plan = self.evaluate(axes, shape, mb, step=graph, bucketed=True, placement=placement)
            seen[signature] = plan
            plans.append(plan)
        over = [p for p in seen.values() if not p.fits]
        if over and self._recomputing is not None:
            try:
                plans += self.recomputing(axes, shape, over)
            except Unsupported as e:
                return plans, [f"{mesh_name(axes, shape)}: {e}"]
        return plans, []

    def recomputing(self, axes, shape, over: list[Plan]) -> list[Plan]:
        """For each plan of one mesh that does not fit, the plan recomputing activations: of the
        activation budgets priced, the fastest that fits, else the one with the lowest peak."""
        assert self._recomputing is not None  # search calls this only with one
        variants = self._recomputing(tuple(axes), tuple(shape))
        return [self._fastest_variant(axes, shape, plan, variants) for plan in over if variants]

    def _fastest_variant(self, axes, shape, plan: Plan, variants: list[tuple[float, StepGraph]]) -> Plan:
        """Of `variants` ([(budget, the mesh's graph recomputing at it)]) at `plan`'s bucket size,
        the fastest that fits (the first of equals), else the one with the lowest peak. The peak
        is known before a step is simulated. From the least recomputing (usually the fastest), a
        variant whose op times alone add up to more than a step already priced is neither
        rebucketed nor simulated (cost_model.step_floor: its step would be longer still, and one
        that fits makes the lowest peak moot): the choice is the one pricing them all makes.
        Llama-3-8B over 128 nodes: 103 of 186 variants that fit not simulated."""
        fitting: dict[int, Plan] = {}
        bucketed: dict[int, StepGraph] = {}
        best = math.inf
        for i in sorted(range(len(variants)), key=lambda i: -variants[i][0]):
            fraction, graph = variants[i]
            if step_floor(self._op_times_for(graph)) > best:
                continue
            bucketed[i] = rebucket(graph, int(plan.bucket_mb * MiB))
            if self.fits(bucketed[i].memory.peak):  # as the plan's own `fits` (pricing leaves memory as it is)
                fitting[i] = self._priced_variant(axes, shape, plan, fraction, bucketed[i])
                best = min(best, fitting[i].prediction.step_s)
        if fitting:
            return min((fitting[i] for i in sorted(fitting)), key=lambda p: p.prediction.step_s)
        lowest = min(sorted(bucketed), key=lambda i: bucketed[i].memory.peak)
        return self._priced_variant(axes, shape, plan, variants[lowest][0], bucketed[lowest])

    def _priced_variant(self, axes, shape, plan: Plan, fraction: float, bucketed: StepGraph) -> Plan:
        priced = self.evaluate(axes, shape, plan.bucket_mb, step=bucketed, bucketed=True, placement=plan.placement)
        priced.recompute = fraction
        return priced


@dataclass(frozen=True)
class MemoryLimit:
    """What a rank may hold (MEMORY_HEADROOM of the device's memory), as ModelSteps asks it of a
    step graph before pricing it recomputing activations."""

    bytes: float
    bucket_mbs: tuple | None = None  # the bucket sizes the search was given (None: its own)

    def over(self, step: StepGraph) -> bool:
        """Whether a plan read from `step` may not fit: at any bucket size the search tries, or with
        one bucket as large as the graph allows. The graphs derived from it hold less."""
        if step.memory.peak > self.bytes:
            return True
        sizes = [*_bucket_candidates(step, self.bucket_mbs), 2**40]
        return any(rebucket(step, int(mb * MiB)).memory.peak > self.bytes for mb in sizes)

    def beyond_recompute(self, step: StepGraph) -> bool:
        """Whether recomputing activations cannot make a plan of `step` fit: what is live at its
        peak besides activations (parameters, optimizer state, gradients, buffers) is over the
        limit already (recomputation leaves those as they are)."""
        m = step.memory
        return m.peak - m.at_peak.get("activations", 0) > self.bytes

    def default_peak(self, step: StepGraph) -> int:
        """The peak of `step` with the default bucket size."""
        return _default_memory(step).peak

    def more_may_help(self, step: StepGraph, sharded: bool) -> bool:
        """Whether a graph recomputing activations does not fit (with the default bucket size) but
        recomputing more might: activations are part of what is live at its peak, enough to matter.
        On a graph with fsdp (`sharded`), whatever else it holds: the meshes read from it with a
        wider fsdp axis hold less of the rest (as ModelSteps gives such a graph its first variant).
        Asked only of the traced fsdp=2 graph, Llama-3-70B's 35 GB of state there hid that every
        layer recomputed fits at fsdp=512, where half of them does not: its best plan at 2,048 nodes
        (tp=1, 559 samples/s) went unpriced for tp=2's (516)."""
        m = _default_memory(step)
        return m.peak > self.bytes and (sharded or not m.peak - m.at_peak.get("activations", 0) > self.bytes)


def _default_memory(step: StepGraph):
    return rebucket(step, int(DEFAULT_BUCKET_MB * MiB)).memory


NCCL_NAMES = {"ring": "ring", "double_binary_tree": "tree"}


def _nccl_name(algorithm: str) -> str:
    return NCCL_NAMES.get(algorithm, algorithm)


def _bucket_candidates(step: StepGraph, given) -> list[float]:
    if given:
        return sorted(set(float(x) for x in given))
    grads = sum(c.input_bytes for c in step.comms if c.kind == "all_reduce")
    sizes = set(BUCKET_MB_CANDIDATES)
    if grads:
        # small models: also split the gradients into 2, 4 and 8 buckets
        sizes |= {max(0.01, round(grads / k / MiB, 2)) for k in (2, 4, 8)}
    return sorted(sizes)


def plan_model(
    model_path: Path,
    profile: dict,
    world_size: int,
    batch_size: int,
    *,
    seed: int = 0,
    bucket_mbs: tuple[float, ...] | None = None,
    axes: tuple[str, ...] | None = None,
    sequence_parallel: bool = False,
    hierarchical: str = "auto",
    precision: str | None = None,
    reduce_dtype: str | None = None,
    reuse: ModelSteps | None = None,
    note=None,
    moe_capacity_factor: float | None = None,
    workers: int | None = None,
):
    """(ranked plans, skipped meshes, planner, model steps) for a model file on a profile.
    `hierarchical`: all_reduces over groups spanning nodes in two levels where cheaper ("auto"),
    wherever they can ("always") or never, as `aot build --hierarchical` builds them. `reuse`: the
    model steps an earlier call returned for the same model file, batch size, seed and sequence
    parallelism on another profile; the graphs that stay valid on this one are not traced again
    (ModelSteps.retargeted), so planning one model for several profiles traces it about once.
    `note(line)` hears each long piece of work as it starts (a trace, a pipeline's programs, each
    quarter of the meshes priced).
    `workers`: processes that trace the model's layout classes, then price its meshes, at once
    (aot.plan.workers; None: default_workers(), about one per core; 1: all in this process)."""
    from aot.garbage_collection import DEFERRED, collected_less_often
    from aot.plan.layout_traces import prefetch
    from aot.plan.workers import default_workers
    from aot.plan.mesh import PLANNED_AXES

    # tracing many small graphs: young collections less often too (aot/garbage_collection.py)
    with collected_less_often(young=50_000, middle=DEFERRED):
        machine = Machine(profile, world_size)
        memory_limit = MemoryLimit(MEMORY_HEADROOM * machine.memory_bytes, bucket_mbs) if machine.memory_bytes else None
        pricing = Pricing(profile, world_size, machine.per_node, precision, reduce_dtype, memory_limit, machine.compute)
        if reuse is not None and reuse.request == (Path(model_path), batch_size, seed, sequence_parallel, moe_capacity_factor):
            steps = reuse.retargeted(pricing)
        else:
            steps = ModelSteps(model_path, batch_size, seed, sequence_parallel, pricing, note=note, moe_capacity_factor=moe_capacity_factor)
        planner = Planner(
            machine,
            steps,
            hierarchical,
            recomputing=steps.recomputing,
            pipeline=steps.pipeline,
            batch_size=batch_size,
            pipeline_holdings=steps.pipeline_holdings,
            note=note,
            # a default search leaves out the layout classes that cannot rank first (as it does
            # pipelines); `--axes` prices every class of the axes asked for
            bound=ClassBound(world_size, machine.compute, steps.class_floors, steps.class_key) if axes is None else None,
        )
        steps.bound = planner.bound
        # every axis the build takes; pipeline meshes only where they could win, unless asked for
        # every axis the planner searches; ep for a model with experts
        searched = tuple(axes or (*PLANNED_AXES, *([EP] if steps.has_experts else [])))
        workers = default_workers() if workers is None else workers
        steps.workers = workers  # `aot plan` says how many planned
        # each layout class's meshes priced where it was traced, as soon as it is
        priced = prefetch(steps, searched, workers, price=planner.priced(searched, bucket_mbs))
        plans, skipped = planner.search(searched, bucket_mbs, prune_pipelines=axes is None, workers=workers, priced=priced)
        steps.seconds["pipelines"] += planner.pipelines_apart_s
    return plans, skipped, planner, steps
