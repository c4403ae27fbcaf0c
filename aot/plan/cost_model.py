"""Cost model of one rank's training step: compute per graph node, collectives over the links
their group spans, memory from graph liveness, and step time with overlap.

`analyze(graph)` reads a captured step graph once (FX, with fake tensors in `meta["val"]`):

- every op's FLOPs (torch.utils.flop_counter's formulas, applied to the fake tensors' shapes) and
  the bytes it reads and writes (views move nothing; they still cost a dispatch);
- every collective with the point where its inputs exist and the point where its result is first
  needed (issue early, wait late: what aot.passes.overlap makes of the graph, so a graph before
  or after that pass gives the same schedule);
- memory: parameters, buffers, optimizer state and the batch are resident; every other storage
  lives from the op that creates it to the last op that reads any view of it; the peak of the sum
  over graph order is the step's transient peak (activations, gradients, buckets, temporaries).

aot.plan.rebucket packs the all_reduces of an unbucketed graph as aot.passes.bucketing would, and
aot.plan.derived_steps re-reads a step for another fsdp degree or without an axis, so candidates are
priced without re-tracing. `simulate(...)` walks the ops in graph order
on two clocks, one for compute and one for communication: a collective starts when both its inputs
exist and the communication clock is free, and the compute clock stalls at a wait until the
collective ends. The step time is when the last op (or collective) finishes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch.utils.flop_counter import flop_registry

from aot.capture.graph_reading import loss_node, storage_key, written_values
from aot.passes.graph_utils import is_view
from aot.passes.graph_utils import tensors as _tensors
from aot.plan.device_model import DeviceModel


_FUNCOL = "_c10d_functional"
_WAIT = "wait_tensor"
_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}
_FREE = {operator.getitem}
_RESIDENT_SLOTS = ("param", "buffer", "optim", "lr", "input", "target")


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

    @property
    def element_size(self) -> int:
        return self.input_bytes // self.input_numel if self.input_numel else 4

    def sized(self, element_size: int) -> "CommSite":
        """This site with `bytes` and `input_bytes` set from its input numel (n of all_gather is
        the output)."""
        self.input_bytes = self.input_numel * element_size
        self.bytes = self.input_bytes * (self.group_size if self.kind == "all_gather" else 1)
        return self


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
    intervals: tuple = ()  # (first node, last node, numel, element size, part) of every transient storage
    length: int = 0  # the graph's nodes: intervals lie in [0, length]
    scale: Callable | None = None  # numel -> numel of a rescaled graph (rescale); intervals keep the traced sizes

    @property
    def resident(self) -> int:
        return self.params + self.buffers + self.optimizer + self.batch

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

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)


# -- reading a graph ----------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _map_args(args):
    return torch.fx.node.map_aggregate(args, lambda a: _val(a) if isinstance(a, torch.fx.Node) else a)


def _flops(node) -> float:
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0.0
    try:
        return float(formula(*_map_args(node.args), **_map_args(node.kwargs), out_val=_val(node)))
    except Exception:  # a formula that does not accept these arguments: count no FLOPs
        return 0.0


def _written_args(node) -> list[torch.Tensor]:
    """The tensors an op that returns nothing writes in place: its arguments the schema marks
    mutable (`Tensor(a!)[] self` of `_foreach_mul_`). They are its output: what it writes counts
    in its bytes (and its elements), as the output of an out-of-place op does."""
    return [t for value in written_values(node) for t in _tensors(_map_args(value))]


def _launches(node, name: str) -> int:
    """A foreach op's tensor count (the length of its first list argument: `_foreach_pow(scalar,
    tensors)` has it second); 1 for other ops."""
    if not name.startswith("_foreach_"):
        return 1
    return max(1, next((len(a) for a in node.args if isinstance(a, (list, tuple))), 1))


def _target_name(target) -> str:
    name = getattr(target, "__name__", None) or str(target)
    schema = getattr(target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else name


def _collective_kind(node) -> str | None:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.name.startswith(_FUNCOL + "::"):
        return None
    return _COLLECTIVES.get(schema.name.split("::")[-1])


def _is_wait(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.name == f"{_FUNCOL}::{_WAIT}"


def _group_size(node) -> int:
    for a in node.args[1:]:
        if isinstance(a, int) and not isinstance(a, bool):
            return a
    return 1


def node_op(node: torch.fx.Node) -> Op:
    """The cost-relevant facts of one compute node (not a collective or a wait)."""
    outs = _tensors(_val(node)) or _written_args(node)
    dtype = str(outs[0].dtype).replace("torch.", "") if outs else "float32"
    name = _target_name(node.target)
    if node.target in _FREE:
        return Op(node.name, name, kind="free", dtype=dtype)
    if is_view(node.target):
        return Op(node.name, name, kind="view", dtype=dtype)
    ins = [t for a in node.all_input_nodes for t in _tensors(_val(a))]
    tensors = tuple((t.numel(), t.element_size(), t.dim() <= 1) for t in (*ins, *outs))
    return Op(
        node.name,
        name,
        flops=_flops(node),
        bytes=float(sum(n * e for n, e, _ in tensors)),
        dtype=dtype,
        tensors=tensors,
        elements=sum(t.numel() for t in outs),
        launches=_launches(node, name),
    )


def node_seconds(node: torch.fx.Node, compute: DeviceModel) -> float:
    """Predicted time of one compute node on `compute` (what recomputing it costs)."""
    return _op_s(node_op(node), compute)


def analyze(gm: torch.fx.GraphModule | torch.fx.Graph, slots: list[dict] | None = None, aliases: dict | None = None) -> StepGraph:
    """The cost-relevant facts of a step graph (see the module docstring). `slots` (the captured
    step's input kinds, in placeholder order) split resident memory into its parts. `aliases`
    (storage key -> storage key) makes values of a graph put together from several traces share the
    storage they would share in one (aot.plan.pricing.derive_without_fsdp)."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    nodes = list(graph.nodes)
    ops: list[Op] = []
    ops_before: dict = {}
    op_of: dict = {}
    comm_nodes = []
    for node in nodes:
        ops_before[node] = len(ops)
        if node.op != "call_function":
            continue
        if _collective_kind(node) is not None:
            comm_nodes.append(node)
            continue
        if _is_wait(node):
            continue
        op_of[node] = len(ops)
        ops.append(node_op(node))

    position = {n: i for i, n in enumerate(nodes)}
    comms = []
    for node in comm_nodes:
        kind = _collective_kind(node)
        assert kind is not None  # comm_nodes holds the collectives only
        val = _val(node.args[0])
        numel = val.numel() if isinstance(val, torch.Tensor) else 0
        elsize = val.element_size() if isinstance(val, torch.Tensor) else 4
        size = _group_size(node) if kind in ("all_gather", "reduce_scatter") else None
        # issue once the latest input exists (aot.passes.overlap: issue early)
        producers = [a for a in node.all_input_nodes if a.op != "placeholder"]
        latest = max(producers, key=position.__getitem__) if producers else None
        issue_at = 0 if latest is None else ops_before[latest] + (1 if latest in op_of else 0)
        # wait before the first op that reads the result (wait late), through the wait node
        readers = [u for w in node.users for u in (w.users if _is_wait(w) else [w])]
        first = min(readers, key=position.__getitem__) if readers else None
        wait_at = len(ops) if first is None or first.op == "output" else ops_before[first]
        dtype = str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else "float32"
        site = CommSite(
            node.name,
            kind,
            str(node.args[-1]),
            0,
            0,
            dtype,
            issue_at,
            max(wait_at, issue_at),
            input_numel=numel,
            group_size=size or 1,
            readers=tuple(sorted(op_of[r] for r in readers if r in op_of)),
        )
        comms.append(site.sized(elsize))
    memory, interval_of = _memory(nodes, slots, aliases or {})
    for node, site in zip(comm_nodes, comms):
        site.buffers = (_interval_of_value(node.args[0], interval_of, aliases), _interval_of_value(node, interval_of, aliases))
    return StepGraph(ops=ops, comms=comms, memory=memory, graph_nodes=len(nodes))


def _interval_of_value(node, interval_of: dict, aliases: dict | None) -> int:
    """The index in memory.intervals of the storage `node`'s value lives in; -1 if resident or none."""
    values = _tensors(_val(node)) if isinstance(node, torch.fx.Node) else []
    if len(values) != 1:
        return -1
    key = storage_key(values[0])
    return interval_of.get((aliases or {}).get(key, key), -1)


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return _nbytes(t)


_PARTS = {"param": "params", "buffer": "buffers", "optim": "optimizer", "lr": "batch", "input": "batch", "target": "batch"}


def _memory(nodes: list, slots: list[dict] | None, aliases: dict | None = None) -> tuple[Memory, dict]:
    """The graph's memory, and each transient storage's index in its intervals (by storage key)."""
    aliases = aliases or {}

    def key_of_storage(t: torch.Tensor):
        key = storage_key(t)
        return aliases.get(key, key)

    placeholders = [n for n in nodes if n.op == "placeholder"]
    resident_keys = set()
    resident = []
    for i, node in enumerate(placeholders):
        kind = slots[i]["kind"] if slots and i < len(slots) else "param"
        for t in _tensors(_val(node)):
            key = key_of_storage(t)
            if key in resident_keys:
                continue
            resident_keys.add(key)
            # the tensor, not its storage: an input may be traced as a slice of a larger batch
            resident.append((_PARTS.get(kind, "params"), t.numel(), t.element_size()))

    loss = loss_node(nodes[0].graph) if nodes else None
    turn = nodes.index(loss) if loss is not None else len(nodes)
    key_of: dict = {}  # node -> storage keys its value lives in
    born: dict = {}  # storage key -> (index, numel, element size, part)
    last: dict = {}  # storage key -> last index that reads it
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            key_of[node] = [key_of_storage(t) for t in _tensors(_val(node))]
            continue
        for a in node.all_input_nodes:
            for key in key_of.get(a, ()):
                last[key] = i
        if node.op == "output":
            for a in node.all_input_nodes:  # what the step returns after the loss: its new state
                for key in key_of.get(a, ()):
                    if key in born and born[key][0] > turn and born[key][3] == "gradients":
                        born[key] = (*born[key][:3], "updated_state")
            continue
        if _is_wait(node):  # the wait returns the collective's own buffer
            key_of[node] = key_of.get(node.args[0], [])
            continue
        keys = []
        for t in _tensors(_val(node)):
            key = key_of_storage(t)
            keys.append(key)
            if key not in resident_keys and key not in born:
                elsize = t.element_size()
                born[key] = (i, _storage_bytes(t) // elsize, elsize, _transient_part(node, i, turn))
                last.setdefault(key, i)
        key_of[node] = keys
    intervals = tuple((start, last.get(key, start), numel, elsize, part) for key, (start, numel, elsize, part) in born.items())
    return memory_of(tuple(resident), intervals, len(nodes)), {key: i for i, key in enumerate(born)}


def _transient_part(node, index: int, turn: int) -> str:
    if _collective_kind(node) is not None or (node.users and all(_collective_kind(u) for u in node.users)):
        return "collective_buffers"  # a collective's result, or a bucket packed for one
    return "activations" if index <= turn else "gradients"


def memory_of(resident: tuple, intervals: tuple, length: int, scale=None) -> Memory:
    """Memory of resident tensors (part, numel, element size) and transient `intervals`, the
    peak found by sweeping the graph's `length` nodes: what is live at each node is a running sum
    of the sizes born and freed there (integer tensors: the planner sweeps graphs of a hundred
    thousand nodes hundreds of times, too slow a loop in Python)."""
    mem = Memory(resident_tensors=resident, intervals=intervals, length=length, scale=scale)
    for part, numel, elsize in resident:
        setattr(mem, part, getattr(mem, part) + numel * elsize)
    if not intervals:
        return mem
    starts, ends, numels, elsizes, parts = zip(*intervals)
    part_index = {part: i for i, part in enumerate(TRANSIENT_PARTS)}
    rows = torch.tensor([part_index[part] for part in parts])
    at = torch.cat([torch.tensor(starts), torch.tensor(ends).clamp(max=length) + 1])
    sizes = torch.tensor(numels, dtype=torch.int64)
    if mem.scale is not None:  # a rescaled graph's sizes: `scale` asked once per distinct size
        distinct, where = sizes.unique(return_inverse=True)
        sizes = torch.tensor([mem.scale(n) for n in distinct.tolist()], dtype=torch.int64)[where]
    sizes = sizes * torch.tensor(elsizes, dtype=torch.int64)
    delta = torch.zeros(len(TRANSIENT_PARTS), length + 2, dtype=torch.int64)
    delta.index_put_((rows.repeat(2), at), torch.cat([sizes, -sizes]), accumulate=True)
    live = delta.cumsum(1)
    total = live.sum(0)
    first_peak = int(total.argmax())  # the first node where the most is live
    if total[first_peak] > 0:
        mem.peak_transient = int(total[first_peak])
        mem.at_peak = dict(zip(TRANSIENT_PARTS, live[:, first_peak].tolist()))
    mem.activations_peak = max(0, int(live[part_index["activations"]].max()))
    return mem


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
    return [_op_s(op, compute) for op in step.ops]


def microbatched_seconds(step: StepGraph, compute: DeviceModel, parts: int) -> float:
    """Seconds of a data-parallel step's ops when its forward and backward run `parts` times, each
    on 1/parts of the batch, and its end (averaging, clipping, the optimizer: from the first read
    of a reduced gradient on) once, as a pipeline runs them over its microbatches. A microbatch's
    op moves at least 1/parts of the bytes (weights it reads are not split), so this is a lower
    bound of the pipeline's compute wherever an op's time grows with its size."""
    reduced = [c.wait_at for c in step.comms if c.kind == "all_reduce" and c.input_numel > 1]
    end = min(reduced, default=len(step.ops))
    scaled = (replace(op, flops=op.flops / parts, bytes=op.bytes / parts, elements=op.elements // parts) for op in step.ops[:end])
    return parts * sum(_op_s(op, compute) for op in scaled) + sum(_op_s(op, compute) for op in step.ops[end:])


def _op_s(op: Op, compute: DeviceModel) -> float:
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

    def run(op: Op, seconds: float):
        nonlocal t
        if events is not None and seconds > 0:
            events.append(("compute", op.name, op.target, t, seconds, {"flops": op.flops, "bytes": op.bytes}))
        t += seconds

    def issue(c: CommSite):
        nonlocal comm_free, comm_total, comm_bytes, t, exposed
        for op in c.pre_ops:
            run(op, _op_s(op, compute))
        algorithm, seconds = comm_cost(c)
        if not overlap:  # blocking: what the calibration saw a collective cost inside a step
            seconds = max(0.0, seconds + stall)
        algos[(c.kind, algorithm)] = algos.get((c.kind, algorithm), 0) + 1
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
            run(op, _op_s(op, compute))

    n = len(step.ops)
    done = 0  # ops run so far
    for k in sorted({n, *(k for k in {*issues, *waits} if k < n)}):
        # the ops before node k, one after another (the same sums as an op at a time)
        if events is None:
            for seconds in times[done:k]:
                t += seconds
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
    compute_s = sum(times) + sum(_op_s(op, compute) for c in step.comms for op in (*c.pre_ops, *c.post_ops))
    return Prediction(
        step_s=step_s,
        compute_s=compute_s,
        comm_s=comm_total,
        exposed_comm_s=exposed,
        collectives=len(step.comms),
        comm_bytes=comm_bytes,
        algorithms=algos,
        memory=step.memory,
        events=events,
    )
