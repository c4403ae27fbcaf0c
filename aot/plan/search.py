"""Strategy search: enumerate plans, predict each one's step time and memory, rank them.

A plan is a mesh (degrees of the axes the build supports, aot.plan.mesh.SUPPORTED_AXES), a
gradient bucket size, and a placement of the mesh on the machine. The model is traced once per
tensor-parallel degree, whatever the world size (ModelSteps: dp x fsdp=2, from which every other
fsdp degree is derived, and dp alone, whose forward and backward are that trace's with the step's
end traced alone), on two cores where there are two; bucket sizes are applied analytically
(cost_model.rebucket) and every candidate is priced by cost_model.simulate, so a search over 1024
GPUs costs a handful of traces.

Plans whose predicted peak memory per rank exceeds MEMORY_HEADROOM of the device's memory are kept
in the table but marked as not fitting and never chosen. Ranking: predicted step time, then
memory, then the fewest collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from aot.errors import AotError
from aot.plan import collectives, hierarchy
from aot.plan.cost_model import Prediction, StepGraph, analyze, op_seconds, rebucket, simulate
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh
from aot.plan.placement import Placement, place

BUCKET_MB_CANDIDATES = (1.0, 4.0, 25.0, 100.0)
DEFAULT_BUCKET_MB = 25.0
MEMORY_HEADROOM = 0.9      # of device memory: the CUDA context, allocator caching and fragmentation take the rest
TIMELINE_FILE = "plan/timeline.json"
MiB = 2**20


class Unsupported(Exception):
    """The build cannot yet trace a graph for this mesh."""


def factorizations(world_size: int, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Every way to give `axes` degrees whose product is world_size (degree 1 allowed)."""
    if not axes:
        return [()] if world_size == 1 else []
    out = []
    for d in range(1, world_size + 1):
        if world_size % d == 0:
            out += [(d, *rest) for rest in factorizations(world_size // d, axes[1:])]
    return out


def strategy_string(axes, shape) -> str:
    return ",".join(f"{a}={d}" for a, d in zip(axes, shape))


@dataclass
class Plan:
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    bucket_mb: float
    placement: Placement
    prediction: Prediction
    fits: bool
    nccl_algo: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def strategy(self) -> str:
        """The --strategy that builds this plan: axes with degree > 1, outermost first (the build
        applies the plan's placement to the mesh written in this order)."""
        size = dict(zip(self.axes, self.shape))
        order = [a for a in self.placement.order if size[a] > 1] or [self.axes[0]]
        return strategy_string(order, [size[a] for a in order])

    def row(self) -> dict:
        p = self.prediction
        return {"strategy": self.strategy, "bucket_mb": self.bucket_mb, "fits": self.fits,
                **p.to_json(), "placement": self.placement.to_json(), "nccl_algo": self.nccl_algo}


class Planner:
    """Prices plans for one machine. `step_graph(axes, shape)` gives the unbucketed step graph of
    one rank for a mesh (raising Unsupported when the build cannot trace it)."""

    def __init__(self, machine: Machine, step_graph: Callable[[tuple, tuple], StepGraph], hierarchical: str = "auto"):
        self.machine = machine
        self.hierarchical = hierarchical  # all_reduces in two levels: "auto" (where cheaper), "always", "never"
        self._step_graph = step_graph
        self._graphs: dict = {}
        self._op_times: dict = {}
        # a search prices every bucket size of a mesh on the same placement: the spans of its
        # groups and the levels of its axes (which walk every rank) are found once per placement
        self._spans: dict = {}
        self._levels: dict = {}

    def step_graph(self, axes, shape) -> StepGraph:
        key = tuple((a, d > 1 if a == "dp" else d) for a, d in zip(axes, shape))
        if key not in self._graphs:
            self._graphs[key] = self._step_graph(tuple(axes), tuple(shape))
        return self._graphs[key]

    def _op_times_for(self, step: StepGraph) -> list[float]:
        key = id(step.ops)
        if key not in self._op_times:
            self._op_times[key] = (step.ops, op_seconds(step, self.machine.compute))
        return self._op_times[key][1]

    # -- collectives ------------------------------------------------------------------------
    def comm_pricer(self, placement: Placement, step: StepGraph, hierarchical: str | None = None) -> tuple[Callable, str | None]:
        """(site -> (algorithm, seconds), NCCL_ALGO setting). The groups of one axis run at once,
        so a collective costs what it costs on the slowest of them. NCCL's algorithm is set per
        collective kind for the whole run (NCCL_ALGO), so each kind gets the one algorithm that
        makes that kind's collectives cheapest in sum; other backends run what they implement."""
        machine = self.machine
        realizable = collectives.REALIZABLE.get(machine.backend, collectives.REALIZABLE["gloo"])
        spans = self._spans

        def spans_of(group: str, kind: str):
            key = (placement, group, kind)
            if key not in spans:
                axis = Mesh.axis_of(group)
                if axis in placement.axes:
                    groups = placement.distinct_groups(axis, machine.per_node)
                else:  # a level of a hierarchical all_reduce ("aot.dp.intra")
                    try:
                        groups = hierarchy.group_ranks(placement, machine, group)
                    except ValueError as e:
                        raise AotError(f"the step's collective names group {group!r}: {e}") from None
                spans[key] = hierarchy.distinct_spans(machine, groups, kind)
            return spans[key]

        def price(site, algorithm: str) -> float:
            kind = site.kind if site.kind in collectives.ALGORITHMS else "all_reduce"
            return max(collectives.cost(kind, algorithm, s, site.bytes) for s in spans_of(site.group, kind))

        pinned: dict[str, str] = {}
        for kind in collectives.KINDS:
            sites = [c for c in step.comms if c.kind == kind]
            options = realizable.get(kind, ("ring",))
            if not sites or len(options) == 1:
                pinned[kind] = options[0]
                continue
            totals = [(sum(price(c, a) for c in sites), i, a) for i, a in enumerate(options)]
            pinned[kind] = min(totals)[2]
        nccl = None
        if machine.backend == "nccl" and step.comms:
            names = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter"}
            used = sorted({c.kind for c in step.comms if c.kind in names})
            nccl = ";".join(f"{names[k]}:{_nccl_name(pinned[k])}" for k in used)

        cache: dict = {}
        levels = self._levels
        hierarchical = hierarchical or self.hierarchical

        def cost(site):
            kind = site.kind if site.kind in collectives.ALGORITHMS else "all_reduce"
            key = (site.group, kind, site.bytes)
            if key not in cache:
                algorithm = pinned.get(kind, "ring")
                cache[key] = (algorithm, price(site, algorithm))
                if kind == "all_reduce" and hierarchical != "never":
                    # a hierarchical all_reduce is three graph collectives over sub-groups
                    # (aot/passes/hierarchical.py), chosen per collective where it is cheaper
                    axis = Mesh.axis_of(site.group)
                    if (placement, axis) not in levels:
                        levels[(placement, axis)] = hierarchy.levels(machine, placement, axis) if axis in placement.axes else None
                    found = levels[(placement, axis)]
                    if found is not None:
                        seconds = hierarchy.hierarchical_seconds(machine, found, site.bytes, algorithm)
                        if hierarchical == "always" or seconds < cache[key][1]:
                            cache[key] = ("hierarchical", seconds)
            return cache[key]
        return cost, nccl

    # -- one plan ---------------------------------------------------------------------------
    def evaluate(self, axes, shape, bucket_mb: float, *, step: StepGraph | None = None, bucketed: bool = False,
                 placement: Placement | None = None, trace: bool = False, as_built: bool = False) -> Plan:
        """Price one plan. `as_built`: the graph is the build's, whose all_reduces were already
        split where hierarchical pays (aot/passes/hierarchical.py): price them as they are."""
        base = step if step is not None else self.step_graph(axes, shape)
        graph = base if bucketed else rebucket(base, int(bucket_mb * MiB))
        if placement is None:
            placement = place(self.machine, tuple(axes), tuple(shape), _traffic(graph))
        cost, nccl = self.comm_pricer(placement, graph, "never" if as_built else None)
        times = self._op_times_for(base)
        prediction = simulate(graph, self.machine.compute, cost, overlap=self.overlaps, trace=trace, op_times=times)
        limit = self.machine.memory_bytes
        fits = limit is None or prediction.memory.peak <= MEMORY_HEADROOM * limit
        return Plan(tuple(axes), tuple(shape), bucket_mb, placement, prediction, fits, nccl)

    @property
    def overlaps(self) -> bool:
        """Whether communication runs beside compute. GPUs: yes (NCCL kernels on their own stream).
        CPU ranks with gloo: its threads copy and reduce on the cores the ranks compute on, so the
        model counts communication as not overlapping."""
        return self.machine.device_kind == "cuda"

    # -- the search ---------------------------------------------------------------------------
    def search(self, axes: tuple[str, ...], bucket_mbs: tuple[float, ...] | None = None) -> tuple[list[Plan], list[str]]:
        """Every mesh over `axes` for the machine's world size x every distinct bucketing, ranked."""
        plans, skipped = [], []
        for shape in factorizations(self.machine.world_size, axes):
            try:
                step = self.step_graph(axes, shape)
            except Unsupported as e:
                skipped.append(f"{strategy_string(axes, shape)}: {e}")
                continue
            placement = None
            seen = {}
            for mb in _bucket_candidates(step, bucket_mbs):
                graph = rebucket(step, int(mb * MiB))
                signature = tuple((c.kind, c.group, c.bytes, c.issue_at, c.wait_at) for c in graph.comms)
                if signature in seen:  # same buckets as a size already priced: the same plan
                    if abs(mb - DEFAULT_BUCKET_MB) < abs(seen[signature].bucket_mb - DEFAULT_BUCKET_MB):
                        seen[signature].bucket_mb = mb
                    continue
                if placement is None:
                    placement = place(self.machine, tuple(axes), tuple(shape), _traffic(graph))
                plan = self.evaluate(axes, shape, mb, step=graph, bucketed=True, placement=placement)
                seen[signature] = plan
                plans.append(plan)
        plans.sort(key=rank_key)
        return plans, skipped


def rank_key(plan: Plan):
    p = plan.prediction
    return (not plan.fits, round(p.step_s, 12), p.memory.peak, p.collectives, abs(plan.bucket_mb - DEFAULT_BUCKET_MB))


_NCCL_NAMES = {"ring": "ring", "double_binary_tree": "tree"}


def _nccl_name(algorithm: str) -> str:
    return _NCCL_NAMES.get(algorithm, algorithm)


def _traffic(step: StepGraph) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in step.comms:
        axis = Mesh.axis_of(c.group)
        out[axis] = out.get(axis, 0.0) + c.bytes
    return out


def _bucket_candidates(step: StepGraph, given) -> list[float]:
    if given:
        return sorted(set(float(x) for x in given))
    grads = sum(c.input_bytes for c in step.comms if c.kind == "all_reduce")
    sizes = set(BUCKET_MB_CANDIDATES)
    if grads:
        # small models: also split the gradients into 2, 4 and 8 buckets
        sizes |= {max(0.01, round(grads / k / MiB, 2)) for k in (2, 4, 8)}
    return sorted(sizes)


# -- from a model file ------------------------------------------------------------------------------

class ModelSteps:
    """Step graphs of a model file for any mesh over the axes the build supports (dp, fsdp, tp).

    Graphs: (dp, fsdp=1) and (dp, fsdp=2) per tensor-parallel degree, each once (the
    data-parallel degree changes only the group's size, never the graph). A wider fsdp axis is the
    fsdp=2 graph re-read with its shards resized (cost_model.rescale), and fsdp without dp is the
    dp x fsdp graph without its dp collectives (cost_model.drop_group), so a search over every
    factorization of 1024 ranks needs two graphs per tp degree. On 2 ranks (no dp x fsdp mesh)
    fsdp=2 is traced alone. tp is priced only within a node (`max_tp`, the ranks per node) and where
    the model can take it (heads and split features divide, aot.plan.tensor_parallel).

    Tracing is most of a search's time. Three things make it cheaper, each giving the very graph
    the build traces for that mesh (tests/test_plan_derived_graphs.py):
    - each trace is recorded without make_fx's bookkeeping (capture_step(for_pricing=True), about
      half the time);
    - the (dp, fsdp=1) graph is derived from the (dp, fsdp=2) one of its tp degree: the same forward
      and backward, then the step's end (averaging, clipping, the optimizer) traced alone
      (aot.capture.step.derive_without_fsdp; traced in full where the graph is not of that form);
    - `prefetch` makes, before the search, the graphs it will ask for, on two cores where there are
      two (aot.plan.trace_helper)."""

    exit_hook = False         # plan_model has asked for a quick exit of the process (once)

    def __init__(self, model_path: Path, batch_size: int, seed: int = 0, world_size: int | None = None,
                 max_tp: int | None = None, sequence_parallel: bool = False):
        from aot.build import _example_batch
        from aot.capture.model_file import load_model_file
        from aot.capture.training_state import build_training_state
        from runner.data import split_batch_tensors

        if batch_size < 1:
            raise AotError(f"--batch-size must be at least 1, got {batch_size}")
        self.mf = load_model_file(model_path)
        self.state = build_training_state(self.mf, seed, 1)
        inputs, targets = split_batch_tensors(_example_batch(self.mf, batch_size), "batch()")
        self.inputs, self.targets = inputs, targets
        self.params = sum(p.numel() for p in self.state.params.values())
        self.param_numels = [p.numel() for p in self.state.params.values()]
        self.world_size = world_size
        self.max_tp = max_tp
        self.sequence_parallel = sequence_parallel   # price tp meshes with sequence parallelism (--sequence-parallel)
        self.traced: dict[tuple, StepGraph] = {}
        self._tp_plan: dict | None = None
        self._failed: dict[tuple, Exception] = {}    # key -> what tracing it raised (raised again when asked)
        self._derived: dict[tuple, list] = {}        # traced key -> [(key, mesh)] derived from its graph (`prefetch`)
        self._helper = None                          # aot.plan.trace_helper.Helper while it traces (`prefetch`)

    def tp_plan(self, tp: int) -> dict[str, str]:
        """The plan the build would use at this degree; Unsupported where the build would refuse."""
        from aot.plan.tensor_parallel import check_degree, check_divisible

        if self.max_tp is not None and tp > self.max_tp:
            raise Unsupported(f"tp={tp} would span nodes ({self.max_tp} ranks per node)")
        try:
            check_degree(self.mf, self.state.model, tp)
            if self._tp_plan is None and self._helper is not None:
                self._tp_plan = self._helper.plan()   # None where it failed: found here, with its error
            if self._tp_plan is None:
                self._tp_plan = self._find_plan()
            if not self._tp_plan:
                raise Unsupported("no Linear pair to split")
            check_divisible(self._tp_plan, self.state.model, tp, "the plan")
        except AotError as e:
            raise Unsupported(str(e)) from None
        return self._tp_plan

    def _find_plan(self) -> dict[str, str]:
        from aot.plan.tensor_parallel import find_plan, user_plan

        return user_plan(self.mf, self.state.model) or find_plan(self.state.model, self.inputs)

    def layout(self, dp: int, fsdp: int, tp: int):
        from aot.capture.step import Group, StepLayout

        group = lambda axis, size: Group(Mesh.group_name(axis), size) if size > 1 else None
        plan = self.tp_plan(tp) if tp > 1 else {}
        sequence = self.sequence_layout(plan, tp) if tp > 1 and self.sequence_parallel else None
        return StepLayout(group("dp", dp), group("fsdp", fsdp), group("tp", tp), tuple(sorted(plan.items())), sequence)

    def sequence_layout(self, plan: dict[str, str], tp: int) -> dict:
        """The build's sequence-parallel layout at this degree; Unsupported where the build would refuse."""
        from aot.plan.tensor_parallel import check_sequence_length, sequence_parallel_layout

        try:
            sequence = sequence_parallel_layout(self.state.model, plan, "the plan")
            check_sequence_length(self.state.model, self.inputs, sequence["blocks"][0], tp)
        except AotError as e:
            raise Unsupported(str(e)) from None
        return sequence

    def capture(self, dp: int, fsdp: int, tp: int = 1) -> StepGraph:
        """The analyzed graph of one rank for a dp x fsdp x tp mesh, traced as the build traces it."""
        return self._capture(dp, fsdp, tp)[0]

    def _capture(self, dp: int, fsdp: int, tp: int):
        from aot.capture.step import capture_step
        from aot.passes.cleanup import drop_profiler_calls, plain_collectives

        # the build checks that every tp rank traces the same program; pricing needs one trace
        captured = capture_step(self.mf, self.state, self.inputs, self.targets, self.layout(dp, fsdp, tp),
                                check_ranks=False, for_pricing=True)
        gm = plain_collectives(drop_profiler_calls(captured.graph))
        return analyze(gm, captured.slots), gm

    def _trace(self, key: tuple, source: tuple) -> dict[tuple, StepGraph]:
        """The graph of `key`, traced on mesh `source`, and the graphs derived from it (`_derived`:
        meshes without fsdp from the fsdp=2 graph of the same tp degree, each traced where the
        derivation does not apply). What a derived graph's own trace raises is raised when asked."""
        from aot.capture.step import derive_without_fsdp

        graph, gm = self._capture(*source)
        out = {key: graph}
        for other, (dp, _, tp) in self._derived.get(key, ()):
            if other in self.traced or other in self._failed:
                continue
            try:
                got = derive_without_fsdp(self.mf, self.state, self.inputs, self.targets, self.layout(dp, 1, tp), gm,
                                          Mesh.group_name("fsdp"))
                derived = analyze(*got) if got is not None else None
            except Exception:  # noqa: BLE001  (traced instead)
                derived = None
            try:
                out[other] = derived if derived is not None else self.capture(dp, 1, tp)
            except Exception as e:  # noqa: BLE001  (raised again when the search asks for this graph)
                self._failed[other] = e
        return out

    def _traced(self, dp: int, fsdp: int, tp: int) -> StepGraph:
        key = (dp > 1, fsdp, tp)
        if key in self._failed:
            raise self._failed[key]
        if key not in self.traced:
            graph = self._helper.take(key) if self._helper is not None else None
            if graph is not None:
                self.traced[key] = graph
                for other, _ in self._derived.get(key, ()):  # made with it; traced when asked where not
                    derived = self._helper.take(other) if self._helper is not None else None
                    if derived is not None:
                        self.traced[other] = derived
            else:
                self.traced.update(self._trace(key, (dp, fsdp, tp)))
        if key in self._failed:
            raise self._failed[key]
        return self.traced[key]

    def _source(self, dp: int, fsdp: int, tp: int) -> tuple[int, int, int]:
        """The traced mesh (dp, fsdp, tp) a mesh's graph is read from (see the class docstring)."""
        if fsdp == 1:
            return dp, 1, tp
        if dp > 1 or (self.world_size or 0) >= 4 * tp:
            return 2, 2, tp
        return 1, 2, tp

    def __call__(self, axes: tuple, shape: tuple) -> StepGraph:
        from aot.plan.cost_model import drop_group, rescale, shard_scale

        degrees = dict(zip(axes, shape))
        other = [a for a, d in degrees.items() if a not in ("dp", "fsdp", "tp") and d > 1]
        if other:
            raise Unsupported(f"no graph for axes {', '.join(other)} yet (priced once the build captures them)")
        dp, fsdp, tp = degrees.get("dp", 1), degrees.get("fsdp", 1), degrees.get("tp", 1)
        if tp > 1:
            self.layout(1, 1, tp)  # Unsupported here, before any trace, where the build would refuse tp
        source = self._source(dp, fsdp, tp)
        base = self._traced(*source)
        if fsdp == 1:
            return base
        graph = base if dp > 1 or source[0] == 1 else drop_group(base, "aot.dp")
        if fsdp == 2:
            return graph
        numels = [s.numel() for s in self.layout(1, 1, tp).local_shapes(self.state).values()]
        return rescale(graph, shard_scale(numels, 2, fsdp), "aot.fsdp", fsdp)

    # -- making the graphs ahead of a search --------------------------------------------------------

    def needed(self, axes: tuple) -> list[tuple]:
        """What a search over `axes` will ask to trace: [(key, (dp, fsdp, tp) traced)] in the order
        it first asks (a mesh refused before any trace is left out; a degree the plan cannot take
        is found out when tracing)."""
        from aot.plan.tensor_parallel import check_degree

        first: dict[tuple, tuple] = {}
        for shape in factorizations(self.world_size or 1, tuple(axes)):
            degrees = dict(zip(axes, shape))
            dp, fsdp, tp = degrees.get("dp", 1), degrees.get("fsdp", 1), degrees.get("tp", 1)
            if any(a not in ("dp", "fsdp", "tp") and d > 1 for a, d in degrees.items()) \
                    or (tp > 1 and self.max_tp is not None and tp > self.max_tp):
                continue
            try:
                if tp > 1:
                    check_degree(self.mf, self.state.model, tp)
            except AotError:
                continue
            source = self._source(dp, fsdp, tp)
            first.setdefault((source[0] > 1, source[1], source[2]), source)
        return list(first.items())

    def prefetch(self, axes: tuple) -> None:
        """Trace, before a search over `axes`, the graphs it will ask for: each graph without fsdp
        derived from the fsdp=2 graph of its tp degree where the search needs that one too, and,
        where a second core is free, part of them in a forked copy of this process
        (aot.plan.trace_helper). What a trace raises is raised again when the search asks for it."""
        from aot.plan import trace_helper

        if self.world_size is None:
            return
        todo = [(key, source) for key, source in self.needed(axes) if key not in self.traced and key not in self._failed]
        sharded = {key[2]: key for key, _ in todo if key[1] == 2}
        for key, source in todo:
            if key[1] == 1 and key[2] in sharded:
                self._derived.setdefault(sharded[key[2]], []).append((key, source))
        jobs = [job for job in todo if not (job[0][1] == 1 and job[0][2] in sharded)]
        mine = sorted(jobs, key=lambda job: job[0][1] != 2)
        find_plan = self._tp_plan is None and any(key[2] > 1 for key, _ in jobs)
        if len(jobs) > 1 and trace_helper.workers() > 1:
            mine, theirs = trace_helper.split(jobs, self._derived, find_plan)
            try:
                self._helper = trace_helper.Helper(self, theirs, find_plan)
            except OSError:  # no fork here: everything in this process
                mine = jobs
        try:
            for key, source in [*mine, *(job for job in jobs if job not in mine)]:
                try:
                    self._traced(*source)
                except Exception as e:  # noqa: BLE001  (raised again when the search asks for this graph)
                    self._failed[key] = e
        finally:
            if self._helper is not None:
                self._helper.close()
                self._helper = None


def plan_model(model_path: Path, profile: dict, world_size: int, batch_size: int, *, seed: int = 0,
               bucket_mbs: tuple[float, ...] | None = None, axes: tuple[str, ...] | None = None,
               sequence_parallel: bool = False, hierarchical: str = "auto"):
    """(ranked plans, skipped meshes, planner, model steps) for a model file on a profile.
    `hierarchical`: all_reduces over groups spanning nodes in two levels where cheaper ("auto"),
    wherever they can ("always") or never, as `aot build --hierarchical` builds them."""
    import atexit
    import gc

    from aot.plan.mesh import SUPPORTED_AXES

    if not ModelSteps.exit_hook:
        # When the process ends, Python's last garbage collections walk every object torch, its
        # compiler stack and the traces made, several times over (about a second of `aot plan`'s
        # run). Frozen at exit (atexit handlers run first), they are skipped: the memory goes with
        # the process.
        ModelSteps.exit_hook = True
        atexit.register(gc.freeze)
    # Tracing makes millions of short-lived objects: with the default thresholds the cyclic garbage
    # collector runs a thousand times and walks every object of torch several times over (a tenth
    # of the search's time). Collect less often while planning.
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], 50_000), max(thresholds[1], 20), max(thresholds[2], 20))
    try:
        machine = Machine(profile, world_size)
        steps = ModelSteps(model_path, batch_size, seed, world_size, max_tp=machine.per_node,
                           sequence_parallel=sequence_parallel)
        planner = Planner(machine, steps, hierarchical)
        searched = tuple(axes or SUPPORTED_AXES)
        steps.prefetch(searched)
        plans, skipped = planner.search(searched, bucket_mbs)
    finally:
        gc.set_threshold(*thresholds)
    return plans, skipped, planner, steps


# -- into the artifact ----------------------------------------------------------------------------

def manifest_entry(planner: Planner, chosen: Plan, graph, slots, ranked: list[Plan], batch_size: int) -> tuple[dict, dict[str, bytes]]:
    """The manifest's `plan` entry and the files it names (the predicted timeline), priced on the
    graph exactly as built (after bucketing and overlap)."""
    import json

    from aot.plan.timeline import chrome_trace

    built = analyze(graph, slots)
    final = planner.evaluate(chosen.axes, chosen.shape, chosen.bucket_mb, step=built, bucketed=True,
                             placement=chosen.placement, trace=True, as_built=True)
    machine = planner.machine
    trace = chrome_trace(final.prediction, title=f"{chosen.strategy}, bucket {chosen.bucket_mb:g} MiB on {machine.describe()}")
    entry = {
        "source": "aot build --strategy auto",
        "strategy": chosen.strategy,
        "bucket_mb": chosen.bucket_mb,
        "batch_size": batch_size,
        "topology": machine.name,
        "calibrated": bool(machine.calibration) or machine.compute.calibrated,
        "overlap": planner.overlaps,
        "placement": chosen.placement.to_json(),
        "nccl_algo": final.nccl_algo,
        "predicted": {**final.prediction.to_json(), "fits": final.fits,
                      "device_memory_bytes": machine.memory_bytes},
        "candidates": [{"strategy": p.strategy, "bucket_mb": p.bucket_mb, "step_s": p.prediction.step_s,
                        "peak_memory_bytes": p.prediction.memory.peak, "collectives_per_step": p.prediction.collectives,
                        "fits": p.fits} for p in ranked[:16]],
        "timeline": TIMELINE_FILE,
    }
    data = (json.dumps(trace, separators=(",", ":")) + "\n").encode()
    return entry, {TIMELINE_FILE: data}


@dataclass
class BuildPlan:
    """The plan `aot build --strategy auto` builds, and how to describe it in the artifact."""
    planner: Planner
    chosen: Plan
    ranked: list[Plan]
    batch_size: int

    @property
    def strategy(self) -> str:
        return self.chosen.strategy

    @property
    def bucket_mb(self) -> float:
        return self.chosen.bucket_mb

    @property
    def all_reduce_algorithm(self) -> str | None:
        """The algorithm the plan pins for NCCL's all_reduces (None: the backend's only one), which
        the build's hierarchical choice prices the flat all_reduce with, as the planner did."""
        for setting in (self.chosen.nccl_algo or "").split(";"):
            kind, _, name = setting.partition(":")
            if kind == "allreduce":
                return next((ours for ours, theirs in _NCCL_NAMES.items() if theirs == name), None)
        return None

    def finish(self, graph, slots) -> tuple[dict, dict[str, bytes]]:
        return manifest_entry(self.planner, self.chosen, graph, slots, self.ranked, self.batch_size)


def plan_for_build(options, profile: dict, progress) -> BuildPlan:
    """Search plans for a build's model, world size and batch size; the best that fits, with the
    placement it was priced with (`chosen.placement`), which the build applies."""
    progress.total += 1
    with progress.stage(f"planning: pricing strategies and bucket sizes on topology {profile['name']!r}"):
        plans, skipped, planner, _ = plan_model(options.model_path, profile, options.world_size, options.batch_size,
                                                seed=options.seed, sequence_parallel=options.sequence_parallel,
                                                hierarchical=options.hierarchical)
        chosen = best_plan(plans)
    p = chosen.prediction
    progress.note(f"plan: --strategy {chosen.strategy} --bucket-mb {chosen.bucket_mb:g}, predicted {p.step_s * 1e3:.3g} ms "
                  f"per step, {p.memory.peak / 2**20:.1f} MiB per rank (best of {len(plans)} candidates)")
    return BuildPlan(planner, chosen, plans, options.batch_size)


def best_plan(plans: list[Plan]) -> Plan:
    fitting = [p for p in plans if p.fits]
    if not fitting:
        smallest = min(plans, key=lambda p: p.prediction.memory.peak) if plans else None
        from runner.inspect import human
        need = f" (the smallest needs {human(smallest.prediction.memory.peak)} per rank)" if smallest else ""
        raise AotError(f"no plan fits the device memory{need}")
    return fitting[0]

