"""The strategy search's pipeline meshes (aot.plan.search.Planner inherits PipelineSearch): which a
default search prices (seeds from the best plans without pp, a memory floor and a time bound),
each priced by simulating its pipeline ranks' programs as built, at several schedules and
microbatch counts, and priced ahead in worker processes one pp degree at a time."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from aot.defaults import DEFAULT_BUCKET_MB
from aot.plan.cost_model import StepGraph, microbatched_seconds
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh
from aot.plan.model_steps import Unsupported
from aot.plan.pipeline import bubble_floor
from aot.plan.placement import identity, place
from aot.plan.plans import MEMORY_HEADROOM, Plan, per_sample_s, rank_key
from runner.commands.formatting import human
from runner.format.axes import DP, EP, FSDP, PP, TP

# What a pipeline mesh is priced at (PipelineSearch.pipeline_plan): microbatches per pipeline rank,
# and (schedule, stages per rank)
PIPELINE_MICROBATCHES_PER_RANK = (1, 2, 4)
PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1))
PIPELINE_SEEDS = 2  # a default search's pipeline meshes come from this many best meshes without pp


class PipelineSearch:
    """The pipeline half of aot.plan.search.Planner: it reads the planner's machine, batch size,
    `_pipeline` (ModelSteps.pipeline), `_pipeline_holdings` (ModelSteps.pipeline_holdings),
    step_graph and evaluate."""

    machine: Machine
    batch_size: int | None
    _pipeline: Callable | None
    _pipeline_holdings: Callable | None
    pipelines_apart_s: float
    _work: StepGraph | None  # pipeline_work's graph
    _work_seconds: dict[int, float]  # microbatches -> microbatched_seconds of _work; pipeline_work resets it
    step_graph: Callable[..., StepGraph]
    evaluate: Callable[..., Plan]

    def fits(self, peak: float) -> bool:
        """Whether a rank peaking at `peak` bytes fits the device (MEMORY_HEADROOM of its memory)."""
        limit = self.machine.memory_bytes
        return limit is None or peak <= MEMORY_HEADROOM * limit

    def _pipelines_ahead(self, axes: tuple, pipelines: list[tuple], plans: list[Plan], seeds: set | None, workers: int) -> dict:
        """{shape: its pipeline_plan, or the Unsupported it raised} for every mesh of `pipelines`
        (one pp degree's) that `search` could price, priced at once by `workers` forked processes
        (aot.plan.workers; a pipeline mesh is minutes of tracing for a 70B model); empty where they
        would run one at a time here anyway (search then prices each as it comes). Each mesh
        `search` prices is among them: its pruning only grows as it goes (a priced pipeline plan
        can only lower the best time per sample that pipeline_may_win compares with), so the
        meshes allowed before this degree's first is priced are a superset, and `search` keeps to
        its own order and discards what it would not have priced: the plans are those of pricing
        one at a time. (One degree at a time: past a degree with more stages than the model has
        layers, search prices none.) `pipelines_apart_s` keeps the wall time, which the workers'
        own clocks (ModelSteps.seconds) do not bring back."""
        from aot.plan.workers import in_workers, will_fork

        candidates = [shape for shape in pipelines if seeds is None or self.unpriced_pipeline(axes, shape, plans, seeds) is None]
        if not will_fork(candidates, workers):
            return {}

        def price(shape):
            try:
                return self.pipeline_plan(axes, shape)
            except Unsupported as e:
                return e

        started = time.perf_counter()
        priced = dict(zip(candidates, in_workers(candidates, price, workers)))
        self.pipelines_apart_s += time.perf_counter() - started
        return priced

    def pipeline_seeds(self, axes: tuple[str, ...], plans: list[Plan]) -> set[tuple]:
        """The pipeline meshes a default search prices: each of the PIPELINE_SEEDS best meshes
        without pp (those that fit first) with pp of its data-parallel ranks made pipeline stages
        (dp's, else fsdp's), for every pp that divides them. Pricing every pipeline mesh traces
        every pipeline rank's program at each schedule, for hundreds of meshes at 16,384 ranks."""
        meshes: list[dict] = []
        for plan in sorted(plans, key=rank_key):
            size = dict(zip(plan.axes, plan.shape))
            if size not in meshes:
                meshes.append(size)
            if len(meshes) == PIPELINE_SEEDS:
                break
        seeds = set()
        for size in meshes:
            for pp in range(2, self.machine.world_size + 1):
                for axis in (DP, FSDP):
                    if size.get(axis, 1) % pp == 0 and axis in axes:
                        derived = {**size, axis: size[axis] // pp, PP: pp}
                        seeds.add(tuple(derived.get(a, 1) for a in axes))
                        break
        return seeds

    def unpriced_pipeline(self, axes: tuple, shape: tuple, plans: list[Plan], seeds: set) -> str | None:
        """Why a default search does not price pipeline mesh `shape` (one of `seeds` or not, none
        fits, none can win), given the plans priced so far; None where it prices it."""
        pp = dict(zip(axes, shape))[PP]
        if shape not in seeds:
            return f"not one of the best plans without pp with {pp} of its data-parallel ranks made stages"
        unfit = self.pipeline_cannot_fit(axes, shape, plans)
        if unfit is not None:
            return unfit
        if not self.pipeline_may_win(plans, pp):
            return (
                "none can beat the best plan without pp: its step's ops, run once per microbatch and spread over every "
                "rank, with the smallest bubble a schedule leaves, are slower per sample"
            )
        return None

    def pipeline_cannot_fit(self, axes: tuple, shape: tuple, plans: list[Plan]) -> str | None:
        """Where a plan in `plans` fits, why no plan of pipeline mesh `shape` can (then it ranks
        after that one); None where one may. A pipeline rank sums each of its parameters'
        gradients over the microbatches whole (fsdp gathers once per step and reduce-scatters after
        the last microbatch: aot/capture/pipeline.py); under fsdp it holds its stages' gathered
        parameters while their forwards and backwards run; beside them its shards of the
        parameters and optimizer state. aot.plan.pipeline_floor.busiest_floor finds the least the
        busiest rank holds at once from the schedule alone, over every stage split; the floor is
        the least of it over every schedule and microbatch count pipeline_plan tries, with or
        without recomputation. For Llama-3-70B at pp=2,tp=2 in fp32 that is 86 GiB a rank, where
        each configuration would cost a minute or more of tracing to find it does not fit."""
        from aot.plan.pipeline import schedule_actions
        from aot.plan.pipeline_floor import busiest_floor

        limit = self.machine.memory_bytes
        if self._pipeline_holdings is None or limit is None or not any(p.fits for p in plans):
            return None
        size = dict(zip(axes, shape))
        pp = size[PP]
        tried = self._microbatch_counts(pp)
        if not tried:
            return None  # pipeline_plan says why none can be priced
        try:
            holdings = self._pipeline_holdings(size.get(FSDP, 1), size.get(TP, 1), size.get(EP, 1))
        except Unsupported:
            return None  # pipeline_plan says why
        floor = min(busiest_floor(holdings, schedule_actions(schedule, pp, m, virtual)) for m in tried for schedule, virtual in PIPELINE_SCHEDULES)
        if floor <= MEMORY_HEADROOM * limit:
            return None
        gathered = ", its stages' gathered parameters while they run" if holdings.gathered else ""
        return (
            f"none fits: each pipeline rank holds its parameters' gradients whole, summed over microbatches until the step's end"
            f"{gathered}, and its shards of the parameters and optimizer state "
            f"({human(floor)} on the busiest rank at the least, at any schedule and split, over the {human(MEMORY_HEADROOM * limit)} a rank may hold)"
        )

    def pipeline_may_win(self, plans: list[Plan], pp: int) -> bool:
        """Whether a mesh with `pp` pipeline stages could rank before the best plan in `plans` that
        fits: true when none fits (the stages split the model's memory), else when its lower bound
        on time per sample is below that plan's. The bound: a pipeline runs each forward and
        backward op once per microbatch on 1/m of the batch, m >= pp (1F1B's fewest), and the
        step's end once (cost_model.microbatched_seconds at m = pp, on the data-parallel mesh's
        graph: W seconds for one batch); its pipeline ranks share W at best, and idle at least the
        smallest bubble share b any schedule pipeline_plan tries leaves at the most microbatches it
        tries that the batch splits into (aot.plan.pipeline.bubble_floor: (pp-1)/(v m + pp-1) for
        1F1B and interleaved, (pp-1)/(3 m + pp-1) for zero-bubble). Per sample: W / world size /
        (1 - b)."""
        fitting = [p for p in plans if p.fits]
        if not fitting:
            return True
        world = self.machine.world_size
        whole = self.pipeline_work(plans)
        if whole is None:
            return True
        # a batch of 2 at pp=2 splits into 2 microbatches only, whose bubble is a third of 1F1B's
        # step, not the 8 pipeline_plan would try
        tried = self._microbatch_counts(pp)
        if not tried:
            return True  # pipeline_plan says why none can be priced
        work = self._work_at(pp)
        m = max(tried)
        bubble = min(bubble_floor(schedule, pp, m, virtual) for schedule, virtual in PIPELINE_SCHEDULES)
        bound = work / world / (1 - bubble)
        return min(per_sample_s(p) for p in fitting) > bound

    def pipeline_work(self, plans: list[Plan]) -> StepGraph | None:
        """The graph of the data-parallel mesh (every rank a data-parallel rank, nothing
        recomputed), whose ops the time bounds on pipelines run once per microbatch: the one
        priced among `plans`, else traced (axes without dp); kept for pipeline_plan's bounds (and
        its worker processes). None where the build cannot make it."""
        world = self.machine.world_size
        whole = next((p for p in plans if p.recompute is None and dict(zip(p.axes, p.shape)).get(DP, 1) == world), None)
        try:
            work = self.step_graph(whole.axes, whole.shape) if whole is not None else self.step_graph((DP,), (world,))
        except Unsupported:
            work = None
        if work is not self._work:
            self._work, self._work_seconds = work, {}
        return self._work

    def _microbatch_counts(self, pp: int) -> list[int]:
        """The microbatch counts pipeline_plan tries that the batch splits into."""
        return [k * pp for k in PIPELINE_MICROBATCHES_PER_RANK if self.batch_size is None or self.batch_size % (k * pp) == 0]

    def _work_at(self, microbatches: int) -> float:
        """microbatched_seconds of pipeline_work's graph: a pass over every op of the step, made
        once per microbatch count."""
        assert self._work is not None
        if microbatches not in self._work_seconds:
            self._work_seconds[microbatches] = microbatched_seconds(self._work, self.machine.compute, microbatches)
        return self._work_seconds[microbatches]

    def _configurations(self, pp: int) -> list[tuple[int, int, str, int, float]]:
        """(its place in the order 1F1B, interleaved, zero-bubble at the fewest microbatches first,
        microbatches, schedule, stages per rank, a lower bound on its time per sample) of each
        configuration pipeline_plan tries, in the order it tries them: by that bound where the
        data-parallel graph is known (pipeline_work; else the bound is 0 and the order 1F1B,
        interleaved, zero-bubble at each microbatch count), zero-bubble after 1F1B at the same
        microbatches (it is not priced where 1F1B's plain programs do not fit). The bound, as
        pipeline_may_win's for one configuration: its ops at m microbatches
        (cost_model.microbatched_seconds), shared by every rank, idle at least its schedule's bubble
        floor: W / world size / (1 - b)."""
        configurations = [(k * pp, schedule, virtual) for k in PIPELINE_MICROBATCHES_PER_RANK for schedule, virtual in PIPELINE_SCHEDULES]
        if self._work is None:
            return [(i, *c, 0.0) for i, c in enumerate(configurations)]
        world, splits = self.machine.world_size, self._microbatch_counts(pp)
        bound = {  # 0 where the batch does not split into m: refused at once, no bound needed
            (m, schedule, virtual): self._work_at(m) / world / (1 - bubble_floor(schedule, pp, m, virtual)) if m in splits else 0.0
            for m, schedule, virtual in configurations
        }

        def order(c):
            m, schedule, _ = c
            return max(bound[c], bound[(m, "1f1b", 1)]) if schedule == "zero-bubble" else bound[c]

        return sorted(((i, *c, bound[c]) for i, c in enumerate(configurations)), key=lambda row: order(row[1:4]))

    def pipeline_plan(self, axes, shape) -> Plan:
        """A pipeline mesh, priced by simulating its pipeline ranks' programs side by side
        (aot.plan.pipeline_timeline) at 1, 2 and 4 microbatches per pipeline rank, with 1f1b,
        interleaved-1f1b (2 stages per rank, where the model has the layers) and zero-bubble: the
        fastest that fits. Where a configuration's plain programs do not fit, it is priced
        recomputing every stage's forward in its backward, as the build then recomputes (not
        zero-bubble, whose build refuses to recompute: it holds activations until the weight
        gradients by design; nor is zero-bubble priced where 1F1B's plain programs do not fit at the
        same microbatches, since every rank of it may hold as many microbatches as 1F1B's first
        rank does). Configurations are tried in the order of a lower bound on their time per
        sample (_configurations), and one whose bound is above a configuration priced that fits is
        not traced: it could not be the fastest, recomputing or not (where that skips 1F1B,
        zero-bubble at the same microbatches is priced). pp is the outermost axis (across nodes);
        the other axes are placed inside it."""
        if self._pipeline is None:
            raise Unsupported("no pipeline graphs for this planner")
        size = dict(zip(axes, shape))
        order = (PP, *[a for a in axes if a != PP])
        ordered = tuple(size[a] for a in order)
        placement = place(self.machine, order, ordered)
        if placement.order[0] != PP and size[PP] < self.machine.world_size:
            placement = identity(order, ordered)
        best = None
        refused: dict[int, Unsupported] = {}  # configuration's place in the plain order -> why the build refuses it
        over: set[int] = set()  # microbatch counts at which 1F1B's plain programs do not fit
        for place_in_order, microbatches, schedule, virtual, bound in self._configurations(size[PP]):
            if schedule == "zero-bubble" and microbatches in over:
                continue  # it holds as many microbatches as 1F1B's first rank on every rank, each until its W
            if best is not None and best.fits and bound > per_sample_s(best):
                continue  # slower, recomputing or not, than a configuration priced that fits
            try:
                plan = self._pipeline_priced(order, ordered, placement, microbatches, schedule, virtual, recompute=False)
            except Unsupported as e:
                refused[place_in_order] = e
                continue
            if schedule == "1f1b" and not plan.fits:
                over.add(microbatches)
            if not plan.fits and schedule != "zero-bubble":  # as the build does over device memory: every stage recomputed, kept if its peak is lower
                try:
                    recomputed = self._pipeline_priced(order, ordered, placement, microbatches, schedule, virtual, recompute=True)
                except Unsupported:  # a stage draws random numbers (dropout): the build would not recompute it either
                    recomputed = None
                if recomputed is not None and recomputed.prediction.memory.peak < plan.prediction.memory.peak:
                    plan = recomputed
            if best is None or rank_key(plan) < rank_key(best):
                best = plan
        if best is None:
            if refused:  # the first reason in the plain order: the fewest microbatches, 1f1b
                raise refused[min(refused)]
            raise Unsupported("no microbatch count fits the batch")
        return best

    def _pipeline_priced(self, order: tuple, ordered: tuple, placement, microbatches: int, schedule: str, virtual: int, recompute: bool) -> Plan:
        """One pipeline configuration: its pipeline ranks' programs as built, simulated side by side."""
        from aot.plan.pipeline_timeline import simulate_pipeline

        assert self._pipeline is not None  # pipeline_plan checks
        programs, analyses = self._pipeline(order, ordered, microbatches, schedule, virtual, recompute=recompute)
        timeline = simulate_pipeline(programs, self, placement, Mesh.group_name(PP))
        busiest = max(range(len(programs)), key=lambda r: timeline.busy_s[r])
        plan = self.evaluate(order, ordered, DEFAULT_BUCKET_MB, step=analyses[busiest], bucketed=True, placement=placement, as_built=True)
        memory = max((a.memory for a in analyses), key=lambda m: m.peak)
        plan.prediction = replace(plan.prediction, step_s=timeline.step_s, memory=memory)
        plan.fits = self.fits(memory.peak)
        plan.pipeline = {
            "microbatches": microbatches,
            "schedule": schedule,
            "stages_per_rank": virtual,
            "bubble_s": timeline.step_s - timeline.busy_s[busiest],
            **({"recompute": "stages"} if recompute else {}),
        }
        return plan
