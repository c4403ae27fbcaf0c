"""Which values of a captured step may differ between the ranks of a mesh axis, read from its graph.

Every rank of an axis runs the same program, so two ranks can only compute different values where
their inputs differ: for data-parallel axes (dp, fsdp) the batch and the random draws (seeded per
data rank, runner/execution/trainer.py `step_seed`), for fsdp every parameter and optimizer-state shard, for
tp the slices of the layers tp splits. A collective over the axis that leaves every rank the same
result (all_reduce, all_gather, broadcast) ends the difference; one that leaves each rank a piece
(reduce_scatter, all_to_all) keeps it. Everything else is the data flow of the graph, in-place
writes included (a value written by a differing value differs from there on) and element by
element through torch's `_foreach_*` ops, which update every parameter in one node.

From that, two uses:

- **The replica proof** (`prove`): after the step, every parameter, its optimizer state and the
  loss-scaling state must be, on each axis, *sharded* (a piece per rank), *reduced* (its update
  passes through a collective over the axis) or *identical* (nothing that differs on the axis
  reaches it). Anything else would let replicas drift apart in silence, so the build refuses it.
- **Partial gradients under tp** (`tp_partial`): a weight tp keeps whole but applies to each
  rank's own heads (Qwen3's per-head q/k RMSNorm) gets on each rank the gradient of its own heads
  only; the true gradient is their sum over tp. A weight is such when every forward use of it meets
  a value that differs between tp ranks; one used on both is refused, as no single reduction
  serves it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from aot.errors import AotError
from aot.capture.graph_reading import COLLECTIVE_NAMESPACES, loss_node, storage_key, written_values
from runner.format.axes import DATA_AXES, DP, EP, FSDP, TP

SHARDED, REDUCED, IDENTICAL, PER_RANK = "sharded", "reduced", "identical", "per rank"
# collectives whose every rank gets the same result, and those that hand each rank its own piece
# node.meta["custom"] key: the clipping coefficient's computation (aot/capture/step.py _clip_distributed).
# One scalar for every gradient: before a weight's tp sum is in the graph, its per-rank part makes
# every rank's norm, and so every update, differ; which weights are such parts is read without it.
CLIP_COEFFICIENT = "aot_clip_coefficient"
_SAME_RESULT = {"all_reduce", "all_reduce_", "all_gather_into_tensor", "all_gather_into_tensor_out", "broadcast", "broadcast_"}
_PIECES = {"reduce_scatter_tensor", "all_to_all_single"}


@dataclass(frozen=True)
class Axis:
    """One mesh axis as the graph sees it: the name its collectives carry, which graph inputs
    differ between its ranks (indices into the step's slots), and whether random draws do."""

    name: str
    group: str
    sources: frozenset[int]
    random_differs: bool
    received_differs: bool  # what a pipeline rank receives from another stage


def axes_of(slots: list[dict], groups: dict, tp_split: set[str], sequence_split: bool = False, ep_split: frozenset[str] = frozenset()) -> list[Axis]:
    """The step's axes (`groups`: axis -> Group with .name, dp / fsdp / ep / tp only) with the
    graph inputs that differ between each one's ranks. `tp_split`: the parameters tp slices;
    `ep_split`: the experts weights ep slices; `sequence_split`: tp ranks hold slices of the
    sequence between layers (sequence parallelism), so what crosses pipeline stages differs
    between them, as it does between data ranks."""
    axes = []
    for axis, group in groups.items():
        if axis not in (DP, FSDP, EP, TP):
            continue  # pipeline ranks run different programs: no single graph speaks for them
        sources = set()
        for i, slot in enumerate(slots):
            kind = slot["kind"]
            if axis in DATA_AXES and kind in ("input", "target"):
                sources.add(i)
            elif axis == FSDP and kind in ("param", "optim"):
                sources.add(i)  # 0-dim state (step counters) too: harmless, it is the same everywhere
            elif axis == TP and kind in ("param", "optim") and slot["name"] in tp_split:
                sources.add(i)
            elif axis == EP and kind in ("param", "optim") and slot["name"] in ep_split:
                sources.add(i)
        axes.append(Axis(axis, group.name, frozenset(sources), random_differs=axis != TP, received_differs=axis != TP or sequence_split))
    return axes


def _collective(node: torch.fx.Node) -> tuple[str, str] | None:
    """(op name, group name) of a functional collective node, else None."""
    if node.op != "call_function" or not hasattr(node.target, "namespace"):
        return None
    if node.target.namespace not in COLLECTIVE_NAMESPACES:
        return None
    name = getattr(node.target, "_opname", "")
    group = next((a for a in reversed(node.args) if isinstance(a, str)), None)
    return (name, group) if group is not None else None


def _random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
    return torch.Tag.nondeterministic_seeded in tags


def _foreach(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(getattr(node.target, "__name__", "")).startswith("_foreach_")


@dataclass
class Flow:
    """For one axis: the nodes whose value differs between its ranks, and the nodes downstream of a
    collective over it that ended a difference ("reduced"), each as of the point it was computed;
    in-place writes mark storages, read from then on."""

    axis: Axis
    differs: dict = field(default_factory=dict)  # node -> bool, or list[bool] for a foreach op's outputs
    reduced: dict = field(default_factory=dict)
    differs_storage: set = field(default_factory=set)
    reduced_storage: set = field(default_factory=set)
    keys: dict = field(default_factory=dict)  # node -> its values' storage keys
    ignore_clipping: bool = False  # the clipping coefficient counts as equal on every rank (CLIP_COEFFICIENT)

    def _get(self, table: dict, storages: set, value, index: int | None = None) -> bool:
        if not isinstance(value, torch.fx.Node):
            return False
        got = table.get(value, False)
        if isinstance(got, list):
            got = got[index] if index is not None and index < len(got) else any(got)
        return bool(got) or (bool(storages) and not storages.isdisjoint(self._storage_keys(value)))

    def _storage_keys(self, node: torch.fx.Node) -> tuple:
        # asked of every input of every node (millions of times at DeepSeek-V3 size): kept per node
        if node not in self.keys:
            self.keys[node] = tuple(storage_key(t) for t in _vals(node))
        return self.keys[node]

    def node_differs(self, value, index: int | None = None) -> bool:
        return self._get(self.differs, self.differs_storage, value, index)

    def node_reduced(self, value, index: int | None = None) -> bool:
        return self._get(self.reduced, self.reduced_storage, value, index)


def _vals(node: torch.fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    return [t for t in val if isinstance(t, torch.Tensor)] if isinstance(val, (list, tuple)) else []


def _args(node: torch.fx.Node) -> list:
    return [*node.args, *node.kwargs.values()]


def flow(graph: torch.fx.Graph, axis: Axis, until: torch.fx.Node | None = None, ignore_clipping: bool = False) -> Flow:
    """Walk the graph once in order (see the module docstring), up to and including `until` where
    given: what the values are at that point, before later in-place writes (the optimizer's update
    of a parameter whose gradient differs) mark their storage. `ignore_clipping`: the clipping
    coefficient is taken as equal on every rank (CLIP_COEFFICIENT)."""
    f = Flow(axis, ignore_clipping=ignore_clipping)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        if i in axis.sources:
            f.differs[node] = True
    for node in graph.nodes:
        if node.op == "call_function":
            _visit(f, node)
        if node is until:
            break
    return f


def _visit(f: Flow, node: torch.fx.Node) -> None:
    """One call's values in `f`: a getitem follows its item, a collective over the axis ends or
    keeps a difference, anything else differs where an argument does; in-place writes mark storages."""
    axis = f.axis
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and isinstance(node.args[1], int):
        source, index = node.args[0], node.args[1]
        f.differs[node] = f.node_differs(source, index)
        f.reduced[node] = f.node_reduced(source, index)
        return
    collective = _collective(node)
    if collective is not None and collective[0] == "irecv":
        f.differs[node], f.reduced[node] = axis.received_differs, False
        return
    if collective is not None and collective[1] == axis.group:
        inputs_differ = any(f.node_differs(a) for a in _args(node) if isinstance(a, torch.fx.Node))
        if collective[0] in _SAME_RESULT:
            f.differs[node] = False
            f.reduced[node] = inputs_differ or any(f.node_reduced(a) for a in _args(node))
        else:
            f.differs[node] = collective[0] in _PIECES or inputs_differ
            f.reduced[node] = any(f.node_reduced(a) for a in _args(node))
        return
    if _foreach(node):
        _foreach_flow(f, node)
        return
    differs = (axis.random_differs and _random(node)) or any(_any(f.node_differs, a) for a in _args(node))
    if f.ignore_clipping and node.meta.get("custom", {}).get(CLIP_COEFFICIENT):
        differs = False
    reduced = any(_any(f.node_reduced, a) for a in _args(node))
    f.differs[node], f.reduced[node] = differs, reduced
    for written in written_values(node):
        for w in written if isinstance(written, (list, tuple)) else [written]:
            _mark(f, w, differs, reduced)


def _any(test, arg) -> bool:
    if isinstance(arg, (list, tuple)):
        return any(test(a) for a in arg if isinstance(a, torch.fx.Node))
    return test(arg)


def _mark(f: Flow, written, differs: bool, reduced: bool) -> None:
    if not isinstance(written, torch.fx.Node):
        return
    for t in _vals(written):
        if differs:
            f.differs_storage.add(storage_key(t))
        if reduced:
            f.reduced_storage.add(storage_key(t))


def _foreach_flow(f: Flow, node: torch.fx.Node) -> None:
    """A `_foreach_*` op: element i of its outputs and of the lists it writes follows element i of
    its list arguments and every non-list argument."""
    args = _args(node)
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and all(isinstance(x, torch.fx.Node) for x in a)]
    n = max((len(a) for a in lists), default=0)
    scalars = [a for a in args if isinstance(a, torch.fx.Node)]
    base_differs = any(f.node_differs(a) for a in scalars)
    base_reduced = any(f.node_reduced(a) for a in scalars)
    differs = [base_differs or any(f.node_differs(a[i]) for a in lists if len(a) == n) for i in range(n)]
    reduced = [base_reduced or any(f.node_reduced(a[i]) for a in lists if len(a) == n) for i in range(n)]
    f.differs[node], f.reduced[node] = differs, reduced
    for written in written_values(node):
        if isinstance(written, (list, tuple)):
            for i, w in enumerate(written):
                _mark(f, w, differs[i], reduced[i])
        else:
            _mark(f, written, any(differs), any(reduced))


@dataclass
class Proof:
    """Per parameter (in slot order), how each axis holds it; buffers that end differing per rank
    (plain BatchNorm's statistics under data parallelism, as eager DDP without broadcast)."""

    params: dict[str, dict[str, str]]
    buffers: dict[str, dict[str, str]]

    def to_json(self) -> dict:
        """The manifest's `replicas` (artifacts/FORMAT.md): per parameter, each axis's handling;
        the buffers kept per rank."""
        per_rank = sorted(n for n, h in self.buffers.items() if PER_RANK in h.values())
        return {"params": {n: dict(sorted(h.items())) for n, h in self.params.items()}, "buffers_per_rank": per_rank}


def prove(graph: torch.fx.Graph, slots: list[dict], axes: list[Axis], where: str = "") -> Proof:
    """The replica proof for one program (see the module docstring); refuses the first parameter
    (or its optimizer state, or the loss-scaling state) that is none of sharded, reduced, identical."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params: dict[str, dict[str, str]] = {}
    buffers: dict[str, dict[str, str]] = {}
    for axis in axes:
        f = flow(graph, axis)
        for i, (slot, node) in enumerate(zip(slots, placeholders)):
            kind = slot["kind"]
            if kind not in ("param", "optim", "buffer", "scaler"):
                continue
            if i in axis.sources:
                how = SHARDED
            elif f.node_differs(node):
                if kind == "buffer" and axis.name in DATA_AXES:
                    buffers.setdefault(slot["name"], {})[axis.name] = PER_RANK
                    continue
                what = {"param": f"parameter {slot.get('name')}", "optim": f"optimizer state {slot.get('key')!r} of {slot.get('name')}"}.get(
                    kind, f"{kind} {slot.get('name') or slot.get('key')}"
                )
                raise AotError(
                    f"{where}{what} would differ between the ranks of {axis.name}: it is not sharded over {axis.name}, its gradient "
                    f"is not reduced over it, and values that differ between those ranks reach it; training would silently diverge"
                )
            else:
                how = REDUCED if f.node_reduced(node) else IDENTICAL
            if kind == "param":
                params.setdefault(slot["name"], {})[axis.name] = how
            elif kind == "buffer":
                buffers.setdefault(slot["name"], {})[axis.name] = how
    return Proof(params, buffers)


def tp_partial(graph: torch.fx.Graph, slots: list[dict], tp: Axis, where: str, declared: frozenset[str] = frozenset()) -> list[str]:
    """The whole (not tp-split) parameters whose update differs between tp ranks because each rank's
    gradient is its own part of a sum (see the module docstring), in slot order. Refuses one whose
    forward uses meet both values that differ between tp ranks and values that do not.

    `declared`: the weights a `tp_plan` entry "replicated_with_grad_allreduce" already sums (the
    graph sums them, so their update no longer differs): a sum is right only where every forward use
    meets split values (else it counts the same gradient once per tp rank), so any other is refused."""
    f = flow(graph, tp, ignore_clipping=True)  # a weight's own gradient, not the norm every gradient shares
    # forward uses read the forward's values: a flow that has not yet seen the update (where a part
    # of a gradient, not yet summed, makes the clipping coefficient and so every update differ)
    forward = flow(graph, tp, until=loss_node(graph))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    partial = []
    for i, (slot, node) in enumerate(zip(slots, placeholders)):
        if slot["kind"] != "param" or i in tp.sources:
            continue
        if slot["name"] in declared:
            meets = _uses_meet(graph, node, forward)
            if not meets or not all(meets):
                raise AotError(
                    f'{where}tp_plan makes {slot["name"]} "replicated_with_grad_allreduce", but it is used on values every tp rank '
                    f"holds alike: summing its gradient over tp would count it once per tp rank; leave it out of tp_plan"
                )
            continue
        if not f.node_differs(node):
            continue
        meets = _uses_meet(graph, node, forward)
        if meets and all(meets):
            partial.append(slot["name"])
        elif meets and any(meets):
            raise AotError(
                f"{where}parameter {slot['name']} is kept whole under tp but used both on values split between the tp ranks and on "
                f"values every tp rank holds alike: no single reduction of its gradient is right; split the layers around it differently"
            )
    return partial


def _uses_meet(graph: torch.fx.Graph, param: torch.fx.Node, f: Flow) -> list[bool]:
    """For each forward op that combines `param` (or what is made from it alone: casts, views,
    gathers of its shards) with other values: whether one of those values differs between ranks."""
    loss = loss_node(graph)
    own = {param}
    meets = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if any(x in own for x in inputs):
            if all(x in own for x in inputs):
                own.add(node)
            else:
                meets.append(any(f.node_differs(x) for x in inputs if x not in own))
        if node is loss:
            break
    return meets


def prove_step(graph: torch.fx.Graph, slots: list[dict], layout, tp_split: set[str], where: str) -> Proof:
    """`prove` over the axes of a step's layout (aot/capture/step.py StepLayout)."""
    groups = {axis: g for axis, g in ((DP, layout.dp), (FSDP, layout.fsdp), (EP, layout.ep), (TP, layout.tp)) if g is not None}
    return prove(graph, slots, axes_of(slots, groups, tp_split, layout.sequence is not None, frozenset(layout.ep_params)), where)


def merged(proofs: list[Proof]) -> Proof:
    """One proof for several programs (pipeline ranks): a parameter held by several of them (a tied
    weight) keeps the handling of the first."""
    params: dict[str, dict[str, str]] = {}
    buffers: dict[str, dict[str, str]] = {}
    for proof in proofs:
        for name, handling in proof.params.items():
            params.setdefault(name, handling)
        for name, handling in proof.buffers.items():
            buffers.setdefault(name, {}).update(handling)
    return Proof(params, buffers)
