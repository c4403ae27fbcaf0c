"""Activation recomputation: recompute forward values in backward instead of keeping them.

Autograd keeps every forward value backward reads (a layer's input, softmax's output, GELU's
input, ...) alive from forward to its backward: at the turn of the step (the loss) these saved
activations are most of a rank's transient memory. Here forward and backward are one graph, so
recomputation is a rewrite of it: a chosen saved value's backward readers are redirected to a
copy of the ops that made it, inserted just before its first backward reader, computed from
values that are kept anyway (parameters, the batch, other saved activations). The forward copy
then dies after its last forward reader.

What may be recomputed: pure aten ops. Never a collective (it would communicate again), never an
op that draws random numbers (dropout's `bernoulli_`) and nothing an in-place op writes: their
results stay saved, so recomputed ops downstream of a random draw read the same draw and the
results are bit-identical to keeping everything.

Choosing what to recompute (a `Choice`, the nodes to copy):
- `by_budget(graph, fraction, cost)`: keep at most `fraction` of the saved activation bytes,
  recomputing the values cheapest per byte freed first (a greedy knapsack priced by `cost`, the
  cost model's seconds per node). Each recomputed value is rebuilt only from values that stay
  saved: a value another recomputation reads is pinned as kept, so a recomputation never chains
  into another (which would rebuild a whole chain of layers at the first backward use, keeping it
  all alive again).
- `by_modules(graph, patterns, save_matmuls)`: `torch.utils.checkpoint` on every call of a module
  whose name matches a pattern (`blocks.*`): everything the call computes is recomputed from its
  inputs, except its outputs (the next call's inputs); with `save_matmuls`, matmul outputs inside
  are kept too and only the cheap ops between them are recomputed (selective checkpointing).
  Module calls are known from the capture's annotations (`MODULE_CALLS` in node.meta["custom"]).
- `by_checkpoint_calls(graph)`: the same for every `torch.utils.checkpoint` call the model made
  (`CHECKPOINT_CALLS`, aot/capture/module_calls.py): the user's own request, written in the model.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch

from aot.capture.module_calls import MODULE_CALLS, checkpoint_call_of
from aot.capture.graph_reading import loss_node, storage_key, written_values
from aot.passes.graph_utils import COLLECTIVES, WAIT, fresh_value, lint, tensors

aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the expensive ones (names, as some exist only in some builds)
MATMULS = {
    getattr(aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(aten, name)
}


@dataclass
class Choice:
    """What to recompute: `nodes` (forward nodes to copy into backward where backward reads them)
    and the saved activation bytes before (`saved_bytes`) and after (`kept_bytes`)."""

    nodes: set = field(default_factory=set)
    saved_bytes: int = 0
    kept_bytes: int = 0
    values: int = 0  # saved values (storages) recomputed
    cost_s: float = 0.0  # predicted seconds of recomputation per step
    kept: set = field(default_factory=set, repr=False)  # owners still saved (checkpointing)
    pinned: set = field(default_factory=set, repr=False)  # owners recomputations read: never recomputed

    @property
    def fraction(self) -> float:
        return self.kept_bytes / self.saved_bytes if self.saved_bytes else 1.0


class Forward:
    """The forward half of a whole-step graph and what backward reads of it, by storage."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.turn = loss_node(graph)
        nodes = list(graph.nodes)
        self.nodes = nodes[: nodes.index(self.turn) + 1] if self.turn is not None else []
        forward = set(self.nodes)
        # Storages by identity of the fake values (a view, `_unsafe_view`, an in-place op's result
        # all share their source's): a storage's owner is the first forward node holding it.
        first: dict = {}
        for node in nodes:
            if node.op == "placeholder":
                for t in tensors(node.meta.get("val")):
                    first.setdefault(storage_key(t), None)
        self.owner: dict = {}  # forward node -> the node whose storage it lives in (None: a graph input's)
        for node in self.nodes:
            if node.op == "placeholder":
                self.owner[node] = None
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                self.owner[node] = node  # a tuple's node: its getitems own the storages
                continue
            self.owner[node] = first.setdefault(storage_key(val), node)
        self.mutated = {self.owner.get(a) for node in nodes for a in _written_nodes(node)} - {None}
        self.saved: dict = {}  # owner -> bytes, for every storage backward reads
        for node in self.nodes:
            if self.owner[node] is not None and any(u not in forward for u in node.users):
                owner = self.owner[node]
                self.saved[owner] = _storage_bytes(owner)

    def recomputable(self, node) -> bool:
        if node.op != "call_function" or node not in self.owner or node is self.turn:
            return False  # the loss stays: it marks where forward ends for every later pass
        if node.target is operator.getitem:
            return self.recomputable(node.args[0])
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
            return False
        if target in COLLECTIVES or target is WAIT or torch.Tag.nondeterministic_seeded in target.tags:
            return False
        if any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments):
            return False
        return self.owner[node] not in self.mutated

    def recipe(self, start, stop: Callable) -> tuple[set, set, set]:
        """The nodes that rebuild `start` from kept values: (nodes, the kept owners it reads that
        `stop` named, owners it reads that must now be kept because they cannot be recomputed)."""
        nodes, stops, extra, todo = set(), set(), set(), [start]
        while todo:
            node = todo.pop()
            if node in nodes:
                continue
            nodes.add(node)
            for a in node.all_input_nodes:
                owner = self.owner.get(a)
                if owner is None:
                    continue  # a graph input (parameter, batch) or a view of one: always there
                if stop(a):
                    stops.add(owner)
                elif self.recomputable(a):
                    todo.append(a)
                else:
                    extra.add(owner)
        return nodes, stops, extra

    def views_of(self, owners: set) -> set:
        return {n for n in self.nodes if self.owner[n] in owners}


def by_budget(graph: torch.fx.Graph, fraction: float, cost: Callable) -> Choice:
    """Keep at most `fraction` of the saved activation bytes, recomputing as little as it can.

    First single values, cheapest per byte freed (cost model seconds per byte); where that cannot
    go low enough (each recomputed value pins the values it is rebuilt from), the model's layers
    (calls of a ModuleList's or Sequential's children, `blocks.3`) are checkpointed whole, one
    more at a time from the first, with single values chosen around them. With fraction 0 the
    result is the most this can recompute: its `fraction` is the smallest feasible budget."""
    return budget_choices(graph, cost)(fraction)


def budget_choices(graph: torch.fx.Graph, cost: Callable) -> Callable[[float], Choice]:
    """by_budget for any number of fractions over one walk of `graph` (the memory-budget search
    asks several)."""
    fwd = Forward(graph)
    layered = _Layered(fwd, _layers(fwd), cost)

    @functools.cache
    def choose(fraction: float) -> Choice:
        best: Choice | None = None
        for k in range(len(layered.layers) + 1):
            choice = layered.with_values(k, fraction)
            if choice.kept_bytes <= fraction * choice.saved_bytes:
                return choice
            if best is None or choice.kept_bytes < best.kept_bytes:
                best = choice
        assert best is not None  # the loop runs at least once (k = 0)
        return best

    return choose


class _Layered:
    """by_budget's search over how many layers to checkpoint, each part found once: the first k
    layers checkpointed is the union of each layer checkpointed alone (a layer's recipes stay
    inside it and stop at values kept, and what crosses between layers is kept), so a search over
    k costs each layer's walk once, not k walks of the graph (the 8B step's 32 layers made it the
    planner's largest cost). Each single value's recipe is found once too."""

    def __init__(self, fwd: Forward, layers: list, cost: Callable):
        self.fwd, self.layers = fwd, layers
        seconds: dict = {}
        self.cost = lambda n: seconds[n] if n in seconds else seconds.setdefault(n, cost(n))
        every = set(layers)
        self.layer_of = {n: _region_of(n, lambda call: call in every) for n in fwd.nodes}
        self.views: dict = {}  # owner -> the forward nodes living in its storage
        for n in fwd.nodes:
            self.views.setdefault(fwd.owner[n], []).append(n)
        self.outputs: dict = {}  # layer -> owners of its values read outside it
        for n in fwd.nodes:
            for a in n.all_input_nodes:
                layer = self.layer_of.get(a)
                if layer is not None and layer != self.layer_of.get(n):
                    self.outputs.setdefault(layer, set()).add(fwd.owner[a])
        self.saved_in: dict = {}  # layer -> the saved owners made inside it
        for owner in fwd.saved:
            if self.layer_of.get(owner) is not None:
                self.saved_in.setdefault(self.layer_of[owner], []).append(owner)
        self.candidates = _value_candidates(fwd, self.cost)
        self._parts: dict = {}

    def _part(self, layer) -> tuple:
        """(values recomputed, nodes, owners pinned, owners kept beyond the saved ones) of `layer`
        checkpointed alone: _checkpoint's walk, restricted to the layer."""
        if layer in self._parts:
            return self._parts[layer]
        fwd, outputs = self.fwd, self.outputs.get(layer, set())
        in_order = [o for o in self.saved_in.get(layer, ()) if o not in outputs and fwd.recomputable(o)]
        chosen = set(in_order)
        nodes, pinned, added = set(), set(), set()
        for owner in in_order:  # graph order: each walk stops at what the earlier ones added, so a set's order made builds differ
            found, stops, extra = fwd.recipe(
                owner,
                lambda a: self.layer_of.get(a) != layer or (fwd.owner[a] in fwd.saved and fwd.owner[a] not in chosen) or fwd.owner[a] in added,
            )
            nodes |= found
            pinned |= stops
            added |= stops | extra
        self._parts[layer] = (chosen, nodes, pinned, added)
        return self._parts[layer]

    def with_values(self, k: int, fraction: float, trail: list | None = None) -> Choice:
        """The first `k` layers checkpointed whole, then single values outside them (cheapest per
        byte first) until `fraction` of the saved bytes is kept. `trail`, where given, gets
        (seconds per byte, bytes freed, kept bytes after it) of each value taken, in order."""
        fwd = self.fwd
        chosen_layers = set(self.layers[:k])
        choice = Choice(saved_bytes=sum(fwd.saved.values()))
        recomputed: set = set()
        added: set = set()
        for layer in self.layers[:k]:
            values, nodes, pinned, more = self._part(layer)
            recomputed |= values
            choice.nodes |= nodes
            choice.pinned |= pinned
            added |= more
        for owner in recomputed:
            choice.nodes.update(self.views.get(owner, ()))
        choice.kept = (set(fwd.saved) - recomputed) | added
        choice.kept_bytes = sum(_storage_bytes(o) for o in choice.kept)
        chosen = {o for o in fwd.saved if o in choice.nodes}
        pinned = set(choice.pinned)
        kept_extra = set(choice.kept) - set(fwd.saved)
        for rate, owner, nodes, stops, extra in self.candidates:
            if choice.kept_bytes <= fraction * choice.saved_bytes:
                break
            if self.layer_of.get(owner) in chosen_layers or owner in pinned or stops & chosen:
                continue
            gain = fwd.saved[owner] - sum(_storage_bytes(e) for e in extra - kept_extra)
            if gain <= 0:
                continue
            chosen.add(owner)
            pinned |= stops
            kept_extra |= extra
            choice.nodes |= nodes
            choice.kept_bytes -= gain
            if trail is not None:
                trail.append((rate, gain, choice.kept_bytes))
        for owner in chosen:
            choice.nodes.update(self.views.get(owner, ()))
        choice.values = len(chosen)
        choice.cost_s = math.fsum(self.cost(n) for n in choice.nodes)  # each copied once; fsum: the same in any set order
        return choice


@dataclass
class Breakpoints:
    """Where by_budget's choices change with the budget, for the planner (issue #42,
    aot/plan/variant_budgets.py).

    `layered[k]`: the bytes kept with the first k layers checkpointed and every single value
    beside them taken, for k = 0 .. every layer: by_budget checkpoints the fewest layers whose
    entry is within the budget. Values alike (the same op in every block) cost the same per byte,
    so with those layers checkpointed the greedy takes them one after another: `runs(k)` is, per
    run of equal seconds per byte, (seconds per byte, values, bytes kept after the run, the least
    bytes one of them frees). A budget between a run's kept bytes and those plus its least value
    (and below `layered[k - 1]`) makes by_budget checkpoint exactly k layers and take exactly the
    runs up to that one."""

    saved_bytes: int
    layered: list
    _layered: "_Layered"

    def runs(self, k: int) -> list[tuple]:
        trail: list = []
        self._layered.with_values(k, 0.0, trail)
        out: list = []
        for rate, gain, kept in trail:
            if out and out[-1][0] == rate:
                _, count, _, least = out[-1]
                out[-1] = (rate, count + 1, kept, min(least, gain))
            else:
                out.append((rate, 1, kept, gain))
        return out


def budget_breakpoints(graph: torch.fx.Graph, cost: Callable) -> Breakpoints:
    """The Breakpoints of by_budget on `graph`."""
    fwd = Forward(graph)
    layered = _Layered(fwd, _layers(fwd), cost)
    kept = [layered.with_values(k, 0.0).kept_bytes for k in range(len(layered.layers) + 1)]
    return Breakpoints(sum(fwd.saved.values()), kept, layered)


def _value_candidates(fwd: Forward, cost: Callable) -> list:
    """Every saved value that can be recomputed alone, cheapest per byte freed first: (seconds per
    byte, owner, the nodes rebuilding it, the saved values it reads, the values it pins)."""
    candidates = []
    for owner, size in fwd.saved.items():
        if size == 0 or not fwd.recomputable(owner):
            continue
        nodes, stops, extra = fwd.recipe(owner, lambda a, o=owner: fwd.owner[a] in fwd.saved and fwd.owner[a] is not o)
        seconds = math.fsum(cost(n) for n in nodes)  # fsum: the same in any set order, so equal candidates tie alike
        gain = size - sum(_storage_bytes(e) for e in extra)
        if gain > 0:
            candidates.append((seconds / gain, owner, nodes, stops, extra))
    candidates.sort(key=lambda c: (c[0], c[1].name))
    return candidates


def _layers(fwd: Forward) -> list:
    """The model's layers, in call order: the outermost calls of a numbered child (`blocks.3`, `0`)."""
    layers = []
    for node in fwd.nodes:
        call = next((c for c in node.meta.get("custom", {}).get(MODULE_CALLS, ()) if c[0].rsplit(".", 1)[-1].isdigit()), None)
        if call is not None and call not in layers:
            layers.append(call)
    return layers


def by_modules(graph: torch.fx.Graph, patterns, save_matmuls: bool, cost: Callable | None = None) -> Choice:
    """Checkpoint every call of a module matching one of `patterns` (fnmatch over dotted names)."""
    fwd = Forward(graph)
    region = {n: _region_of(n, lambda call: any(fnmatch.fnmatchcase(call[0], p) for p in patterns)) for n in fwd.nodes}
    choice = _checkpoint(fwd, region, lambda n: save_matmuls and fwd.owner[n] is not None and getattr(fwd.owner[n], "target", None) in MATMULS)
    choice.cost_s = math.fsum(cost(n) for n in choice.nodes) if cost else 0.0
    return choice


def by_checkpoint_calls(graph: torch.fx.Graph, cost: Callable | None = None) -> Choice:
    """Recompute every torch.utils.checkpoint call of the model's forward from its inputs."""
    fwd = Forward(graph)
    region = {n: checkpoint_call_of(n) for n in fwd.nodes}
    choice = _checkpoint(fwd, region, lambda n: False)
    choice.cost_s = math.fsum(cost(n) for n in choice.nodes) if cost else 0.0
    return choice


def has_checkpoint_calls(graph: torch.fx.Graph) -> bool:
    """Whether the model's forward called torch.utils.checkpoint (see by_checkpoint_calls)."""
    return any(checkpoint_call_of(n) is not None for n in graph.nodes)


def _checkpoint(fwd: Forward, region: dict, keep: Callable) -> Choice:
    """Recompute every saved value made inside a region (one module call) from the region's
    inputs, except its outputs (read outside the call) and the values `keep` names."""
    outputs = {fwd.owner[a] for n in fwd.nodes for a in n.all_input_nodes if region.get(a) is not None and region[a] != region.get(n)}
    chosen = {o for o in fwd.saved if region.get(o) is not None and o not in outputs and fwd.recomputable(o) and not keep(o)}
    choice = Choice(saved_bytes=sum(fwd.saved.values()))
    kept = set(fwd.saved) - chosen
    for owner in [o for o in fwd.saved if o in chosen]:  # graph order, as in _Layered._part
        nodes, stops, extra = fwd.recipe(owner, lambda a, r=region[owner]: region.get(a) != r or fwd.owner[a] in kept or keep(a))
        choice.nodes |= nodes
        choice.pinned |= stops
        kept |= stops | extra  # the call's inputs, the values kept inside and what cannot be recomputed stay
    choice.nodes |= fwd.views_of(chosen)
    choice.kept = kept
    choice.kept_bytes = sum(_storage_bytes(o) for o in kept)
    choice.values = len(chosen)
    return choice


def _region_of(node, matches: Callable):
    """The outermost module call around `node` that `matches` ((name, number) -> bool)."""
    calls = node.meta.get("custom", {}).get(MODULE_CALLS, ())
    return next((call for call in calls if matches(call)), None)


def recompute_activations(gm: torch.fx.GraphModule, choice: Choice) -> torch.fx.GraphModule:
    """Redirect every backward reader of a node in `choice.nodes` to a copy of it made just before
    the first backward node that needs it (its inputs copied the same way when they are chosen
    too, the rest read from forward)."""
    if not choice.nodes:
        return gm
    graph = gm.graph
    turn = loss_node(graph)
    nodes = list(graph.nodes)
    backward = nodes[nodes.index(turn) + 1 :]
    copies: dict = {}
    changed: set = set()  # nodes whose value now lives in a recomputed storage: every copy, as it is made

    def materialize(node, anchor):
        if node not in choice.nodes:
            return node
        if node not in copies:
            with graph.inserting_before(anchor):
                copy = graph.node_copy(node, lambda a: materialize(a, anchor))
            fresh_value(copy)
            copies[node] = copy
            changed.add(copy)
        return copies[node]

    key = lambda n: storage_key(n.meta["val"]) if isinstance(n.meta.get("val"), torch.Tensor) else None
    # backward nodes that view an input (detach, transpose): their values must follow the copy's storage
    aliasing = {n for n in backward if key(n) is not None and key(n) in {key(a) for a in n.all_input_nodes} - {None}}
    for node in backward:
        for a in node.all_input_nodes:
            if a in choice.nodes:
                node.replace_input_with(a, materialize(a, node))
        if node in aliasing and any(a in changed for a in node.all_input_nodes):
            fresh_value(node)
            changed.add(node)
    for node in reversed(nodes[: nodes.index(turn)]):  # forward nodes only backward read are now dead
        if node in choice.nodes and not node.users:
            graph.erase_node(node)
    lint(graph)
    gm.recompile()
    return gm


def _written_nodes(node) -> list:
    return [v for value in written_values(node) for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.fx.Node)]


def _storage_bytes(node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return int(val.untyped_storage().nbytes())
    except Exception:
        return val.numel() * val.element_size()
