"""Reading a step graph for the cost model (aot/plan/cost_model.py): each node's facts, then the
step's StepGraph assembled from them.

`analyze(graph)` reads a captured step graph once (FX, with fake tensors in `meta["val"]`):

- every op's FLOPs (torch.utils.flop_counter's formulas, applied to the fake tensors' shapes) and
  the bytes it reads and writes (views move nothing; they still cost a dispatch);
- every collective with the point where its inputs exist and the point where its result is first
  needed (issue early, wait late: what aot.passes.overlap makes of the graph, so a graph before
  or after that pass gives the same schedule);
- memory: parameters, buffers, optimizer state and the batch are resident; every other storage
  lives from the op that creates it to the last op that reads any view of it; the peak of the sum
  over graph order is the step's transient peak (activations, gradients, buckets, temporaries).

It does so in two halves: `read` makes a NodeRecord of every node (its op, its inputs as record
indices, the storages its value lives in), and `assemble` computes the step from the records
alone. Records are what aot.plan.step_synthesis writes out to a deep model's depth from a shallow
model's, so a step no graph holds is assembled as a graph's is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch.utils.flop_counter import flop_registry

from aot.capture.graph_reading import loss_node, storage_key, written_values
from aot.passes.graph_utils import is_view
from aot.passes.graph_utils import tensors as _tensors
from aot.plan.cost_model import FLAT, NOT_FLAT, PADDED_WHOLE, CommSite, Op, StepGraph, memory_of, op_time
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
_PARTS = {"param": "params", "buffer": "buffers", "optim": "optimizer", "lr": "batch", "input": "batch", "target": "batch"}
COLLECTIVE_BUFFERS = "collective_buffers"


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


def is_compute(node: torch.fx.Node) -> bool:
    """Whether the cost model reads `node` as a compute op (a function call, not a collective or its wait)."""
    return node.op == "call_function" and not _is_wait(node) and _collective_kind(node) is None


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
    return op_time(node_op(node), compute)


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except Exception:
        return _nbytes(t)


# -- the records ------------------------------------------------------------------------------


@dataclass
class NodeRecord:
    """What the cost model reads off one node of a step graph."""

    kind: str  # "placeholder", "compute", "collective", "wait", "output" or "other" (get_attr)
    inputs: tuple[int, ...] = ()  # the records of the node's input nodes (all_input_nodes' order)
    keys: tuple = ()  # the storage each tensor of its value lives in, numbered (a wait's: its collective's)
    sizes: tuple = ()  # per tensor: (numel, numel of its storage, element size, NOT_FLAT, FLAT or PADDED_WHOLE)
    part: str = ""  # placeholder: its resident part; else COLLECTIVE_BUFFERS where it is or feeds only collectives
    op: Op | None = None  # compute: its cost
    comm: CommSite | None = None  # collective: its site, but for where it is issued, waited and read
    source: int | None = None  # collective: the record of its input tensor (args[0])
    loss: bool = False  # the step's loss: forward ends here


def read(gm: torch.fx.GraphModule | torch.fx.Graph, slots: list[dict] | None = None, aliases: dict | None = None, priced: bool = True) -> list[NodeRecord]:
    """A NodeRecord of every node of `gm`, in graph order (see `analyze`). Without `priced`, no
    op's cost nor collective's site is read (`peak_memory` needs neither)."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    aliases = aliases or {}
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    loss = loss_node(graph) if nodes else None
    out: list[NodeRecord] = []
    ids: dict = {}
    placeholders = 0
    for node in nodes:
        record = NodeRecord("other", inputs=tuple(index[a] for a in node.all_input_nodes), loss=node is loss)
        values = _tensors(_val(node))
        # each storage by a number: a storage key hashes in Python, and assembling a deep step
        # looks its storages up millions of times
        record.keys = tuple(ids.setdefault(aliases.get(k, k), len(ids)) for k in map(storage_key, values))
        classes = _shape_classes(node, values, out, index)
        record.sizes = tuple((t.numel(), _storage_bytes(t) // t.element_size(), t.element_size(), c) for t, c in zip(values, classes))
        if node.op == "placeholder":
            kind = slots[placeholders]["kind"] if slots and placeholders < len(slots) else "param"
            record.kind, record.part = "placeholder", _PARTS.get(kind, "params")
            placeholders += 1
        elif node.op == "output":
            record.kind = "output"
        elif node.op == "call_function" and _is_wait(node):
            source = out[index[node.args[0]]]
            record.kind, record.keys, record.sizes = "wait", source.keys, source.sizes
        elif node.op == "call_function" and _collective_kind(node) is not None:
            record.kind, record.comm = "collective", _site(node) if priced else None
            record.source = index[node.args[0]] if isinstance(node.args[0], torch.fx.Node) else None
        elif node.op == "call_function":
            record.kind, record.op = "compute", node_op(node) if priced else None
        if record.kind != "placeholder" and (_collective_kind(node) is not None or (node.users and all(_collective_kind(u) for u in node.users))):
            record.part = COLLECTIVE_BUFFERS  # a collective's result, or a bucket packed for one
        out.append(record)
    return out


def _shape_classes(node, values: list, records: list[NodeRecord], index: dict) -> list[int]:
    """The shape class (aot.plan.cost_model.NOT_FLAT, FLAT or PADDED_WHOLE) of each tensor of
    `node`'s value (`records`: those of the nodes before it)."""
    classes = [NOT_FLAT if t.dim() > 1 else FLAT for t in values]
    if FLAT not in classes:
        return classes
    kind = _collective_kind(node)
    if kind == "all_gather" or (node.users and all(_collective_kind(u) == "reduce_scatter" for u in node.users)):
        return [PADDED_WHOLE if c == FLAT else c for c in classes]
    if kind is not None or node.op != "call_function":
        return classes
    wholes = {size[0] for a in node.all_input_nodes for size in records[index[a]].sizes if size[3] == PADDED_WHOLE}
    return [PADDED_WHOLE if c == FLAT and t.numel() in wholes else c for t, c in zip(values, classes)]


def collective_sites(gm: torch.fx.GraphModule) -> list[CommSite]:
    """The collectives of `gm`, each as `analyze` reads it (what it moves, over which group), in
    graph order; not where it is issued or waited for."""
    return [_site(n) for n in gm.graph.nodes if n.op == "call_function" and _collective_kind(n) is not None]


def _site(node) -> CommSite:
    kind = _collective_kind(node)
    assert kind is not None  # a collective's node
    val = _val(node.args[0])
    numel = val.numel() if isinstance(val, torch.Tensor) else 0
    elsize = val.element_size() if isinstance(val, torch.Tensor) else 4
    size = _group_size(node) if kind in ("all_gather", "reduce_scatter") else None
    dtype = str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else "float32"
    strided = tuple(val.shape) if isinstance(val, torch.Tensor) and not val.is_contiguous() else None
    return CommSite(node.name, kind, str(node.args[-1]), 0, 0, dtype, 0, 0, input_numel=numel, group_size=size or 1, strided_shape=strided).sized(elsize)


def assemble(records: list[NodeRecord]) -> StepGraph:
    """The step of `records` (see `analyze`)."""
    ops: list[Op] = []
    ops_before: list[int] = []
    op_of: dict[int, int] = {}
    users: list[list[int]] = [[] for _ in records]
    for i, r in enumerate(records):
        ops_before.append(len(ops))
        for a in r.inputs:
            users[a].append(i)
        if r.kind == "compute":
            assert r.op is not None  # a compute record has its op
            op_of[i] = len(ops)
            ops.append(r.op)
    sites = []
    for i, r in enumerate(records):
        if r.kind != "collective":
            continue
        assert r.comm is not None  # a collective's record has its site
        # issue once the latest input exists (aot.passes.overlap: issue early)
        producers = [a for a in r.inputs if records[a].kind != "placeholder"]
        latest = max(producers, default=None)
        issue_at = 0 if latest is None else ops_before[latest] + (1 if latest in op_of else 0)
        # wait before the first op that reads the result (wait late), through the wait node
        readers = [u for w in users[i] for u in (users[w] if records[w].kind == "wait" else [w])]
        first = min(readers, default=None)
        wait_at = len(ops) if first is None or records[first].kind == "output" else ops_before[first]
        readers_at = tuple(sorted(op_of[u] for u in readers if u in op_of))
        sites.append((i, replace(r.comm, issue_at=issue_at, wait_at=max(wait_at, issue_at), readers=readers_at, pre_ops=[], post_ops=[])))
    memory, interval_of = _memory(records)

    def interval(i: int | None) -> int:
        keys = records[i].keys if i is not None else ()
        return interval_of.get(keys[0], -1) if len(keys) == 1 else -1

    for i, site in sites:
        site.buffers = (interval(records[i].source), interval(i))
    return StepGraph(ops=ops, comms=[site for _, site in sites], memory=memory, graph_nodes=len(records))


def analyze(gm: torch.fx.GraphModule | torch.fx.Graph, slots: list[dict] | None = None, aliases: dict | None = None) -> StepGraph:
    """The cost-relevant facts of a step graph (see the module docstring). `slots` (the captured
    step's input kinds, in placeholder order) split resident memory into its parts. `aliases`
    (storage key -> storage key) makes values of a graph put together from several traces share the
    storage they would share in one (aot.plan.pricing.derive_without_fsdp)."""
    return assemble(read(gm, slots, aliases))


def peak_memory(gm: torch.fx.GraphModule, slots: list[dict] | None = None) -> int:
    """The step's predicted peak memory per rank: `analyze(gm, slots).memory.peak`, without pricing
    its ops (the memory-budget search measures a step's peak several times per build)."""
    return _memory(read(gm, slots, priced=False))[0].peak


def _memory(records: list[NodeRecord]):
    """The step's memory, and each transient storage's index in its intervals (by storage key)."""
    resident_keys: set = set()
    resident = []
    turn = next((i for i, r in enumerate(records) if r.loss), len(records))
    born: dict = {}  # storage key -> (index, numel, element size, part, shape class)
    last: dict = {}  # storage key -> last index that reads it
    for i, r in enumerate(records):
        if r.kind == "placeholder":
            for key, (numel, _, elsize, _) in zip(r.keys, r.sizes):
                if key not in resident_keys:
                    resident_keys.add(key)
                    # the tensor, not its storage: an input may be traced as a slice of a larger batch
                    resident.append((r.part, numel, elsize))
            continue
        for a in r.inputs:
            for key in records[a].keys:
                last[key] = i
        if r.kind == "output":
            for a in r.inputs:  # what the step returns after the loss: its new state
                for key in records[a].keys:
                    if key in born and born[key][0] > turn and born[key][3] == "gradients":
                        born[key] = (*born[key][:3], "updated_state", born[key][4])
            continue
        if r.kind == "wait":  # the wait returns the collective's own buffer
            continue
        for key, (_, storage, elsize, shape) in zip(r.keys, r.sizes):
            if key not in resident_keys and key not in born:
                born[key] = (i, storage, elsize, r.part or ("activations" if i <= turn else "gradients"), shape)
                last.setdefault(key, i)
    intervals = tuple((start, last.get(key, start), *rest) for key, (start, *rest) in born.items())
    return memory_of(tuple(resident), intervals, len(records)), {key: i for i, key in enumerate(born)}
