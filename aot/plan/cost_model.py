"""Cost model of one rank's training step: compute per graph node, collectives over the links
their group spans, memory from graph liveness, and step time with overlap.

A step is a StepGraph: its ops, its collectives (CommSite: where each is issued and waited for)
and its memory, read off a captured step graph by aot.plan.step_reading.analyze.

aot.plan.rebucket packs the all_reduces of an unbucketed graph as aot.passes.bucketing would, and
aot.plan.derived_steps re-reads a step for another fsdp degree or without an axis, so candidates are
priced without re-tracing. `simulate(...)` walks the ops in graph order
on two clocks, one for compute and one for communication: a collective starts when both its inputs
exist and the communication clock is free, and the compute clock stalls at a wait until the
collective ends. The step time is when the last op (or collective) finishes.
"""

from __future__ import annotations

import functools
import operator
from typing import Any
from dataclasses import dataclass, field, replace

import torch

from aot.plan.device_model import DeviceModel


@dataclass
class Op:
    name: str
    target: str
    flops: float = 0.0
    bytes: float = 0.0
    dtype: str = "float32"
    kind: str = "compute"  # compute (moves bytes), view (dispatch only), free (no cost)
    tensors: tuple = ()  # (numel, element size, flat) of every tensor read or written: `bytes` is their sum
    elements: int = 0  # elements the op writes (its outputs' numel)
    launches: int = 1  # kernels it runs: a foreach op runs one per tensor of its list on CPUs


@dataclass
class CommSite:
    """One collective: issued once `issue_at` ops have run, waited for before op `wait_at` runs.
    `bytes` is n of the alpha-beta formulas (the whole tensor: all_gather output, reduce_scatter
    input, all_reduce buffer); `input_bytes` is what the graph's node takes."""

    name: str
    kind: str
    group: str
    bytes: int
    input_bytes: int
    dtype: str
    issue_at: int
    wait_at: int
    members: int = 1
    pre_ops: list[Op] = field(default_factory=list)  # packing, run on the compute clock before issue
    post_ops: list[Op] = field(default_factory=list)  # unpacking, run after the wait
    input_numel: int = 0
    group_size: int = 1
    readers: tuple = ()  # indices of the ops that read the result
    # (input, result): indices into the step's memory.intervals of the storages the collective
    # reads and makes (-1: resident, or none), so a pass that packs collectives re-times them
    buffers: tuple = (-1, -1)
    # the input's shape, where it is laid out other than contiguously (a batched matmul's
    # gradient): bucketing copies it contiguous before packing it (aot.passes.bucketing)
    strided_shape: tuple | None = None

    @property
    def element_size(self) -> int:
        return self.input_bytes // self.input_numel if self.input_numel else 4

    def sized(self, element_size: int) -> "CommSite":
        """This site with `bytes` and `input_bytes` set from its input numel (n of all_gather is
        the output)."""
        self.input_bytes = self.input_numel * element_size
        self.bytes = self.input_bytes * (self.group_size if self.kind == "all_gather" else 1)
        return self


def changed(record, **fields):
    """A copy of dataclass `record` (an Op, a CommSite) with `fields` set: dataclasses.replace
    without its per-field constructor call, for the hundreds of thousands of records a search
    resizes (these dataclasses check nothing at construction)."""
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__, **fields)
    return new


# What a transient storage is, by where the graph makes it: forward (up to the loss) makes
# activations; collectives and the buckets packed for them are collective buffers; the step's
# outputs made after the loss are the updated parameters and optimizer state; everything else
# backward makes is gradients (and backward's temporaries).
TRANSIENT_PARTS = ("activations", "gradients", "collective_buffers", "updated_state")


@dataclass
class Memory:
    params: int = 0
    buffers: int = 0
    optimizer: int = 0
    batch: int = 0
    peak_transient: int = 0  # activations, gradients, buckets and temporaries at their peak
    at_peak: dict = field(default_factory=dict)  # peak_transient by TRANSIENT_PARTS
    activations_peak: int = 0  # the most bytes of forward-made storages live at any point
    resident_tensors: tuple = ()  # (part, numel, element size) of every resident storage
    intervals: tuple = ()  # (first node, last node, numel, element size, part, shape class) of every transient storage
    length: int = 0  # the graph's nodes: intervals lie in [0, length]
    scale: Any = None  # derived_steps.ShardScale of a rescaled graph (rescale); intervals keep the traced sizes
    # births and deaths per part and node, kept by memory_with on the step it corrects (not on what
    # it makes: a search keeps every plan's memory)
    sweep: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # `intervals` as integer tensors (interval_columns), shared by the memories rescale makes of one graph
    columns: tuple | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """What a planning worker sends back (aot.plan.workers): not the columns, made again where needed."""
        return {**self.__dict__, "columns": None}

    @property
    def resident(self) -> int:
        return self.params + self.buffers + self.optimizer + self.batch

    def figures(self) -> "Memory":
        """This memory's figures without the storages they were read from: what a plan keeps (a
        search keeps hundreds of plans, and a worker sends each back to the planner; a deep step's
        intervals are a hundred thousand tuples, half a megabyte pickled)."""
        return replace(self, resident_tensors=(), intervals=(), scale=None, sweep=None, columns=None)

    @property
    def peak(self) -> int:
        return self.resident + self.peak_transient

    def itemized(self) -> dict:
        """The manifest's `memory.predicted` (artifacts/FORMAT.md)."""
        return {
            "peak": self.peak,
            "peak_transient": self.peak_transient,
            "resident": {"params": self.params, "buffers": self.buffers, "optimizer": self.optimizer, "batch": self.batch},
            "at_peak": {part: self.at_peak.get(part, 0) for part in TRANSIENT_PARTS},
            "activations_peak": self.activations_peak,
        }

    def to_json(self) -> dict:
        return {
            "params": self.params,
            "buffers": self.buffers,
            "optimizer": self.optimizer,
            "batch": self.batch,
            "peak_transient": self.peak_transient,
            "peak": self.peak,
            "at_peak": {part: self.at_peak.get(part, 0) for part in TRANSIENT_PARTS},
            "activations_peak": self.activations_peak,
        }


@dataclass
class StepGraph:
    ops: list[Op]
    comms: list[CommSite]
    memory: Memory
    graph_nodes: int
    # aot.plan.derived_steps.rescale's: (the graph this one was resized from, the indices of the
    # ops it replaced); its other ops are that graph's own Op objects, whose seconds the search
    # reuses (Planner._op_times_for: a deep step has a hundred thousand ops, a few percent resized)
    resized_from: tuple | None = field(default=None, repr=False, compare=False)
    flat_ops: list | None = field(default=None, repr=False, compare=False)  # rescale's: its ops with a flat tensor, found once
    # aot.plan.rebucket's: what packing its all_reduces takes at any bucket size, found once (the
    # search rebuckets a graph at every size it tries, and each recomputing variant at those)
    packing: Any = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """What a planning worker sends back (aot.plan.workers): not the packing, found again where needed."""
        return {**self.__dict__, "packing": None}

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)


# What a storage is to a wider or narrower fsdp axis (aot.plan.derived_steps.rescale, whose
# ShardScale resizes it): shaped tensors keep their size; flat ones (0-d or 1-d) are resized where
# they have a shard's size, or a padded whole parameter's: what an all_gather makes, what a
# reduce-scatter takes, and flat values of the same size computed from those (a shard's size is
# tried first for the other flat ones). aot.plan.step_reading classes each storage.
NOT_FLAT, FLAT, PADDED_WHOLE = 0, 1, 2


def memory_of(resident: tuple, intervals: tuple, length: int, scale=None, columns: tuple | None = None) -> Memory:
    """Memory of resident tensors (part, numel, element size) and transient `intervals`, the
    peak found by sweeping the graph's `length` nodes: what is live at each node is a running sum
    of the sizes born and freed there (integer tensors: the planner sweeps graphs of a hundred
    thousand nodes hundreds of times, too slow a loop in Python). `columns`: interval_columns of
    another Memory of the same intervals (a graph rescale resizes), else made when needed."""
    mem = Memory(resident_tensors=resident, intervals=intervals, length=length, scale=scale, columns=columns)
    for part, numel, elsize in resident:
        setattr(mem, part, getattr(mem, part) + numel * elsize)
    if intervals:
        delta = _births_and_deaths(mem)
        _swept(mem, delta)
        if scale is not None:  # a graph the search resized: memory_with corrects it next, for each bucket size
            mem.sweep = delta
    return mem


def memory_with(memory: Memory, changed: dict[int, tuple], added: tuple = ()) -> Memory:
    """`memory` with the intervals at the indices of `changed` replaced by its values, and the
    intervals `added`: the sweep of `memory` corrected by what changed (aot.plan.rebucket moves a
    few hundred of a deep step's hundred thousand intervals, for every bucket size of every mesh).
    A changed interval is the same storage re-timed: only its first and last node differ."""
    intervals = list(memory.intervals)
    for i, interval in changed.items():
        intervals[i] = interval
    intervals += added
    mem = replace(memory, intervals=tuple(intervals), peak_transient=0, at_peak={}, activations_peak=0, sweep=None, columns=None)
    if not intervals:
        return mem
    if memory.sweep is None:
        memory.sweep = _births_and_deaths(memory)
    delta = memory.sweep
    if changed or added:
        delta = delta.clone()
        # what is taken away and what is put back, in one pass: the changed intervals' columns are
        # the graph's own (made once per graph), with their new first and last nodes
        index = torch.tensor(list(changed), dtype=torch.int64)
        before = tuple(column[index] for column in interval_columns(memory))
        nodes = torch.tensor([v[:2] for v in changed.values()], dtype=torch.int64).reshape(-1, 2)
        after = (before[0], nodes[:, 0], nodes[:, 1], *before[3:])
        columns = tuple(torch.cat(parts) for parts in zip(before, after, *([_columns(added)] if added else [])))
        signs = torch.tensor([-1] * len(changed) + [1] * (len(changed) + len(added)), dtype=torch.int64)
        _add_births_and_deaths(delta, columns, memory.length, memory.scale, signs)
    _swept(mem, delta)
    return mem


def _births_and_deaths(memory: Memory) -> torch.Tensor:
    """[part, node]: the bytes of each part born (+) and freed (-) at each node of `memory`."""
    delta = torch.zeros(len(TRANSIENT_PARTS), memory.length + 2, dtype=torch.int64)
    _add_births_and_deaths(delta, interval_columns(memory), memory.length, memory.scale, 1)
    return delta


def interval_columns(memory: Memory) -> tuple:
    """`_columns` of memory.intervals, made once per Memory and handed on to the memories of the
    same intervals (aot.plan.derived_steps.rescale makes one per fsdp degree of a deep graph)."""
    if memory.columns is None:
        memory.columns = _columns(memory.intervals)
    return memory.columns


def _add_births_and_deaths(delta: torch.Tensor, columns: tuple, length: int, scale, sign) -> None:
    """Add the births and deaths of the intervals whose `_columns` are `columns` in `delta`, each
    times `sign` (1, -1 to take them away, or a tensor of one per interval)."""
    rows, starts, ends, sizes, elsizes, shapes = columns
    at = torch.cat([starts, ends.clamp(max=length) + 1])
    if scale is not None:  # a rescaled graph's flat storages, by their shape class: `scale` asked once per distinct size
        distinct, where = sizes.unique(return_inverse=True)
        for kind, resize in ((FLAT, scale), (PADDED_WHOLE, scale.full_first)):
            sizes = torch.where(shapes == kind, torch.tensor([resize(n) for n in distinct.tolist()], dtype=torch.int64)[where], sizes)
    sizes = sign * sizes * elsizes
    delta.index_put_((rows.repeat(2), at), torch.cat([sizes, -sizes]), accumulate=True)


def _columns(intervals: tuple) -> tuple:
    """(part row, start, end, numel, element size, shape class) of `intervals` as integer tensors
    (making them from Python lists is most of a sweep's time)."""
    starts, ends, numels, elsizes, parts, shapes = zip(*intervals)
    part_index = {part: i for i, part in enumerate(TRANSIENT_PARTS)}
    return (
        torch.tensor([part_index[part] for part in parts]),
        torch.tensor(starts),
        torch.tensor(ends),
        torch.tensor(numels, dtype=torch.int64),
        torch.tensor(elsizes, dtype=torch.int64),
        torch.tensor(shapes, dtype=torch.int64),
    )


def _swept(mem: Memory, delta: torch.Tensor) -> None:
    """`mem`'s peaks from its births and deaths."""
    live = delta.cumsum(1)
    total = live.sum(0)
    first_peak = int(total.argmax())  # the first node where the most is live
    if total[first_peak] > 0:
        mem.peak_transient = int(total[first_peak])
        mem.at_peak = dict(zip(TRANSIENT_PARTS, live[:, first_peak].tolist()))
    mem.activations_peak = max(0, int(live[TRANSIENT_PARTS.index("activations")].max()))


# -- step time ---------------------------------------------------------------------------------


@dataclass
class Prediction:
    step_s: float
    compute_s: float  # sum of op times (the step with free communication)
    comm_s: float  # sum of collective times
    exposed_comm_s: float  # time the compute clock stalled at waits
    collectives: int
    comm_bytes: int  # n summed over the step's collectives
    algorithms: dict  # (kind, algorithm) -> count
    memory: Memory
    events: list | None = None

    def to_json(self) -> dict:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "collectives_per_step": self.collectives,
            "collective_bytes_per_step": self.comm_bytes,
            "algorithms": {f"{k}:{a}": n for (k, a), n in sorted(self.algorithms.items())},
            "memory_bytes": self.memory.to_json(),
        }


def op_seconds(step: StepGraph, compute: DeviceModel) -> list[float]:
    return [op_time(op, compute) for op in step.ops]


def microbatched_seconds(step: StepGraph, compute: DeviceModel, parts: int) -> float:
    """Seconds of a data-parallel step's ops when its forward and backward run `parts` times, each
    on 1/parts of the batch, and its end (averaging, clipping, the optimizer: from the first read
    of a reduced gradient on) once, as a pipeline runs them over its microbatches. A microbatch's
    op moves at least 1/parts of the bytes (weights it reads are not split), so this is a lower
    bound of the pipeline's compute wherever an op's time grows with its size."""
    reduced = [c.wait_at for c in step.comms if c.kind == "all_reduce" and c.input_numel > 1]
    end = min(reduced, default=len(step.ops))
    scaled = (replace(op, flops=op.flops / parts, bytes=op.bytes / parts, elements=op.elements // parts) for op in step.ops[:end])
    return parts * sum(op_time(op, compute) for op in scaled) + sum(op_time(op, compute) for op in step.ops[end:])


def op_time(op: Op, compute: DeviceModel) -> float:
    if op.kind == "free":
        return 0.0
    if op.kind == "view":
        return compute.view_seconds()
    return compute.op_seconds(op.flops, op.bytes, op.dtype, target=op.target, elements=op.elements, launches=op.launches)


def _segments(step: StepGraph, times: list[float]) -> tuple[list[float], list[str]]:
    """Seconds of compute before each collective since the ranks last met: since the previous
    collective was issued, and for the step's first, since the step before's last (steps run back
    to back with nothing else that joins the ranks, so its tail and this step's head run apart);
    and the collectives' kinds, in issue order.

    Counting the first from the step's start priced examples/mlp.py's tp=4 step at 4 ranks on 2
    cores as 0.4 ms of compute before its one all_reduce where the ranks run 1.3 ms apart (the
    backward and optimizer after it, then the next forward), and its stall from 0.4 ms's."""
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    issued = sorted(step.comms, key=lambda c: c.issue_at)
    at = [c.issue_at for c in issued]
    if not at:
        return [], []
    wrapped = prefix[-1] - prefix[at[-1]] + prefix[at[0]]
    return [wrapped] + [prefix[i] - prefix[j] for j, i in zip(at[:-1], at[1:])], [c.kind for c in issued]


def _counted_as(c: CommSite, algorithm: str) -> tuple[str, str] | None:
    """How a collective counts in a prediction's `algorithms`: the three collectives of an
    all_reduce split in two levels (over "aot.<axis>.intra" and ".inter", aot/passes/hierarchical.py)
    as one hierarchical all_reduce, counted at its level across nodes."""
    level = c.group.rsplit(".", 1)[-1]
    if level == "inter":
        return ("all_reduce", "hierarchical")
    if level == "intra":
        return None
    return (c.kind, algorithm)


def step_floor(times: list[float]) -> float:
    """A step `simulate` cannot beat, from its op times alone: their sum, added as the simulation
    adds them (in order, from 0.0). The simulation's clock adds the same times in the same order
    with waits and packing ops between them, and a rounded addition of more never gives less, so
    its step is at least this, to the last bit (Python's own `sum` compensates from 3.12: not the
    same bits)."""
    return functools.reduce(operator.add, times, 0.0)


def simulate(step: StepGraph, compute: DeviceModel, comm_cost, *, overlap: bool = True, trace: bool = False, op_times: list[float] | None = None) -> Prediction:
    """Predicted step time. `comm_cost(site) -> (algorithm, seconds)`. With overlap=False every
    collective blocks the compute clock from issue to completion (ranks whose communication
    competes with compute for the same cores), and the step pays `compute.blocking_stall` more
    (the calibrated in-step stall, as the median step of these collectives pays it), spread
    evenly over them."""
    times = op_times if op_times is not None else op_seconds(step, compute)
    issues: dict[int, list[CommSite]] = {}
    waits: dict[int, list[CommSite]] = {}
    for c in step.comms:
        issues.setdefault(c.issue_at, []).append(c)
        waits.setdefault(c.wait_at, []).append(c)
    events: list[tuple] | None = [] if trace else None
    t = comm_free = 0.0
    exposed = comm_total = 0.0
    end: dict[str, float] = {}
    algos: dict = {}
    comm_bytes = 0
    stall = 0.0 if overlap or not step.comms else compute.blocking_stall(*_segments(step, times)) / len(step.comms)
    # a collective's packing and unpacking ops, each priced once (the step's compute sums them again)
    side_s: dict[int, float] = {}

    def side_seconds(op: Op) -> float:
        seconds = side_s.get(id(op))
        if seconds is None:
            seconds = side_s[id(op)] = op_time(op, compute)
        return seconds

    def run(op: Op, seconds: float):
        nonlocal t
        if events is not None and seconds > 0:
            events.append(("compute", op.name, op.target, t, seconds, {"flops": op.flops, "bytes": op.bytes}))
        t += seconds

    def issue(c: CommSite):
        nonlocal comm_free, comm_total, comm_bytes, t, exposed
        for op in c.pre_ops:
            run(op, side_seconds(op))
        algorithm, seconds = comm_cost(c)
        if not overlap:  # blocking: what the calibration saw a collective cost inside a step
            seconds = max(0.0, seconds + stall)
        counted = _counted_as(c, algorithm)
        if counted is not None:
            algos[counted] = algos.get(counted, 0) + 1
        start = max(t, comm_free)
        comm_free = start + seconds
        end[c.name] = comm_free
        comm_total += seconds
        comm_bytes += c.bytes
        if events is not None:
            events.append(
                ("comm", c.name, f"{c.kind} {algorithm}", start, seconds, {"bytes": c.bytes, "group": c.group, "algorithm": algorithm, "members": c.members})
            )
        if not overlap and comm_free > t:
            exposed += comm_free - t
            if events is not None:
                events.append(("compute", f"wait_{c.name}", "wait (blocking)", t, comm_free - t, {}))
            t = comm_free

    def wait(c: CommSite):
        nonlocal t, exposed
        done = end[c.name]
        if done > t:
            if events is not None:
                events.append(("compute", f"wait_{c.name}", "wait", t, done - t, {}))
            exposed += done - t
            t = done
        for op in c.post_ops:
            run(op, side_seconds(op))

    n = len(step.ops)
    done = 0  # ops run so far
    for k in sorted({n, *(k for k in {*issues, *waits} if k < n)}):
        # the ops before node k, one after another (the same sums as an op at a time: reduce adds
        # in order, in C, a deep step's tens of thousands of ops for every plan a search prices)
        if events is None:
            t = functools.reduce(operator.add, times[done:k], t)
        else:
            for j in range(done, k):
                run(step.ops[j], times[j])
        done = k
        # waits first: a collective may take another's result as its input (on one FIFO
        # communication stream the order does not change any start or end time)
        here = waits.get(k, ())
        for c in here:
            if c.name in end:
                wait(c)
        for c in issues.get(k, ()):
            issue(c)
        for c in here:
            if c.issue_at == k:
                wait(c)
    step_s = max(t, comm_free)
    compute_s = sum(times) + sum(side_seconds(op) for c in step.comms for op in (*c.pre_ops, *c.post_ops))
    return Prediction(
        step_s=step_s,
        compute_s=compute_s,
        comm_s=comm_total,
        exposed_comm_s=exposed,
        collectives=len(step.comms),
        comm_bytes=comm_bytes,
        algorithms=algos,
        memory=step.memory.figures(),
        events=events,
    )
