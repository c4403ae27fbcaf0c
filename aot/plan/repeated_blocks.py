"""A deep model's step graph made from a trace of the model cut to a few of its blocks.

Tracing is most of planning's time, and it grows with depth: make_fx takes about 11 s for
Llama-3-8B's 32-layer step on this machine, under 1 s for the same step cut to 3 layers. A
decoder's blocks repeat, so the planner traces the model with its longest list of identical blocks
(`find_blocks`) cut to KEEP of them (`truncated`), and `stamp` writes the middle block's nodes out
to full depth: its parameters' placeholders and their gathers, its forward, its backward, its
gradients' reductions and its elements of the optimizer's lists. The result is the graph a trace
of the whole model gives, node for node but for node names (tests/test_repeated_blocks.py compares
them), so the passes, the cost model and the plan-equals-build checks run on it unchanged.

Which block a node belongs to: placeholders by the name of the tensor they hold; forward nodes by
their module call (aot.capture.module_calls); backward nodes by the annotation made while autograd
ran each block's backward (module_calls.annotating_blocks); the nodes before the forward and after
the backward (gathers, reductions, the optimizer) by what they read. A model the stamping cannot
reproduce (blocks whose nodes differ, a value outside the blocks read from the middle block other
than through a list) raises NotComposable, and the planner traces it whole.
"""

from __future__ import annotations

import copy
import difflib
import operator
import re
from dataclasses import replace
from typing import Any, Callable

import torch

from aot.capture.backward_reads import BackwardReads
from aot.capture.graph_reading import storage_key
from aot.capture.module_calls import BLOCK_BACKWARD, CHECKPOINT_CALLS, MODULE_CALLS, STAMPED_BLOCK, block_backward_of, layer_of
from aot.compile_step import Recording
from aot.passes.graph_utils import fake_in_storage

KEEP = 3  # blocks traced: the first, one in the middle (the one written out) and the last
MIN_BLOCKS = KEEP + 1  # fewer blocks than this are traced whole


class NotComposable(Exception):
    """The cut model's graph cannot be written out to full depth (the message says why)."""


def find_blocks(model: torch.nn.Module) -> tuple[str, int] | None:
    """(dotted name, count) of the model's longest ModuleList, Sequential or ModuleDict keyed 0, 1, ...
    (torchtitan's) of at least MIN_BLOCKS
    blocks alike: one class, the same parameter and buffer shapes, and the same settings (every
    plain attribute of the block and its submodules, but one that is each block's own index:
    gemma's sliding and global attention layers differ there). A list inside a block of another list (a layer's
    experts) is not a candidate. None if there is none."""
    best: tuple[str, int] | None = None
    for name, module in model.named_modules():
        if not name or not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            continue
        if list(module._modules) != [str(i) for i in range(len(module._modules))]:
            continue  # a ModuleDict keyed other than 0, 1, ... (torchtitan's layers are keyed so)
        if any(part.isdigit() for part in name.split(".")):
            continue  # inside a numbered block
        children = list(module.children())
        if len(children) < MIN_BLOCKS or len({type(c) for c in children}) != 1:
            continue
        if len({_shapes(c) for c in children}) == 1 and _shapes(children[0]) and _alike(children) and (best is None or len(children) > best[1]):
            best = (name, len(children))
    return best


def _alike(blocks: list[torch.nn.Module]) -> bool:
    """Whether the blocks' plain settings agree, but for those that are each block's index."""
    settings = [_settings(b) for b in blocks]
    index = {k for k in settings[0] if all(type(s.get(k)) is int and s.get(k) == i for i, s in enumerate(settings))}
    return all({k: v for k, v in s.items() if k not in index} == {k: v for k, v in settings[0].items() if k not in index} for s in settings)


def _shapes(module: torch.nn.Module) -> tuple:
    return tuple((n, tuple(t.shape), t.dtype) for n, t in [*module.named_parameters(), *module.named_buffers()])


_PLAIN = (bool, int, float, str, type(None))


def _settings(block: torch.nn.Module) -> dict:
    """(submodule, attribute) -> value of the plain attributes of `block` and its submodules (a
    layer_idx kept for a cache among them: `_alike` reads past those)."""
    out = {}
    for path, module in block.named_modules():
        for attr, value in vars(module).items():
            if attr.startswith("_") or "init" in attr:  # how weights are drawn (torchtitan's weight_init_std): no step reads it
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                out[(path, attr)] = value
    return out


def truncated(rec: Recording, blocks: str, keep: int = KEEP) -> Recording:
    """The recording with the block list `blocks` cut to its first `keep` blocks: the same module
    objects, the training state restricted to the parameters, buffers and optimizer state kept."""
    model = _cut(rec.state.model, blocks.split("."), keep)
    state = rec.state
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    buffers: dict[str, torch.Tensor] = dict(model.named_buffers())
    kept = set(params) | set(buffers)
    slots = [(n, k) for n, k in state.optimizer_slots if n in params]
    keys = {f"{n}:{k}" for n, k in slots}
    cut = replace(
        state,
        model=model,
        params=params,
        buffers=buffers,
        optimizer_slots=slots,
        optimizer_state={k: v for k, v in state.optimizer_state.items() if k in keys},
        optimizer_fills={k: v for k, v in state.optimizer_fills.items() if k in keys},
        param_groups=[[n for n in group if n in params] for group in state.param_groups],
        aliases={k: v for k, v in state.aliases.items() if v in kept},
        state_dict_keys=[k for k in state.state_dict_keys if k in kept or state.aliases.get(k) in kept],
    )
    return Recording(rec.mf, cut, rec.inputs, rec.targets)


def _cut(module: torch.nn.Module, path: list[str], keep: int) -> torch.nn.Module:
    """A shallow copy of `module` whose submodule at `path` keeps its first `keep` children."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    child = module._modules[path[0]]
    assert child is not None
    if len(path) > 1:
        out._modules[path[0]] = _cut(child, path[1:], keep)
    else:
        listed = copy.copy(child)
        listed._modules = dict(list(child._modules.items())[:keep])
        out._modules[path[0]] = listed
    return out


def cut_plan(plan: dict[str, str], blocks: str, keep: int = KEEP) -> dict[str, str]:
    """A tensor-parallel plan restricted to the modules of the model cut to `keep` blocks."""
    prefix = re.compile(rf"^{re.escape(blocks)}\.(\d+)(\.|$)")
    return {n: s for n, s in plan.items() if not ((m := prefix.match(n)) and int(m.group(1)) >= keep)}


def widen_plan(plan: dict[str, str], blocks: str, depth: int) -> dict[str, str]:
    """A tensor-parallel plan found on the cut model, read out to the deep one: the first block's
    layers as they are, the middle block's for every block but the first and last, the last
    block's for the deep model's last."""
    prefix = re.compile(rf"^{re.escape(blocks)}\.(\d+)(\..*|)$")
    out: dict[str, str] = {}
    for name, style in plan.items():
        m = prefix.match(name)
        if m is None:
            out[name] = style
            continue
        index, rest = int(m.group(1)), m.group(2)
        deep = [0] if index == 0 else range(1, depth - 1) if index == 1 else [depth - 1]
        out.update({f"{blocks}.{i}{rest}": style for i in deep})
    return out


def widened_reads(reads: BackwardReads, blocks: str, depth: int) -> BackwardReads:
    """aot.capture.backward_reads' finding on the cut model, read out to the deep one as
    `widen_plan` reads a plan out (a deep block reads what its counterpart in the cut does): the
    model's forward at full depth, run for it, was a second of an 8B plan's."""

    def widened(names: frozenset[str]) -> frozenset[str]:
        return frozenset(widen_plan(dict.fromkeys(names, ""), blocks, depth))

    return BackwardReads(widened(reads.reached), widened(reads.read))


# -- writing the middle block out -----------------------------------------------------------------


class _Layers:
    """Which of the KEEP blocks each node of the cut model's graph belongs to (None: none), and each
    block's nodes in graph order (`nodes[b]`), matched to the middle block's (`middle_of`).

    A block's own nodes are its parameters' placeholders, its forward (module calls) and its
    backward (module_calls.BLOCK_BACKWARD). Any other node belongs to the block of what it reads
    (a parameter's gather, a gradient's reduction, per-parameter optimizer math), except where
    it reads the value a block hands on: the gradient block 0 passes back to the embedding, the
    last block's output, whose counterparts in the middle block are read by the next block."""

    def __init__(self, graph: torch.fx.Graph, slots: list[dict], blocks: str):
        self.prefix = blocks + "."
        nodes = list(graph.nodes)
        self.of: dict[torch.fx.Node, int | None] = {n: self._tag(n) for n in nodes}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for node, slot in zip(placeholders, slots):
            # a tensor registered in one block but read by several (a shared buffer) is in none
            block = self.block_of_name(slot.get("name", ""))
            self.of[node] = block if {self.of[u] for u in node.users} - {None} <= {block} else None
        own = {n for n in nodes if self.of[n] is not None}
        if not own:
            raise NotComposable("no node of the step is in a block")
        self._index(nodes)
        # whether the middle block's counterpart of a block's own node is read outside the blocks
        self._read_outside = {n: any(u not in own for u in n.users) for n in self.nodes[1]}
        for node in nodes:
            if node not in own:
                self.of[node] = self._read_from(node, own)
        for node, after in reversed(list(zip(nodes, nodes[1:]))):
            if node.op == "call_function" and not node.all_input_nodes:
                self.of[node] = self.of[after]  # a factory reading nothing (tp's meta `empty` per weight): with what follows it
        self._index(nodes)

    def _index(self, nodes) -> None:
        """Each block's nodes, and which of the middle block's nodes each of the first and last
        block's is (`middle_of`; `in_block[b]` the other way). The first and last blocks may have
        nodes the middle one has not (under sequence parallelism the first block's input is split
        and the last block's output gathered): those have no counterpart."""
        self.nodes = [[n for n in nodes if self.of[n] == b] for b in range(KEEP)]
        middle = self.nodes[1]
        self.middle_of: dict = {n: n for n in middle}
        self.in_block: list[dict] = [{}, {n: n for n in middle}, {}]
        key = lambda n: (n.op, "placeholder" if n.op == "placeholder" else str(n.target))  # noqa: E731
        for b in (0, KEEP - 1):
            matcher = difflib.SequenceMatcher(None, [key(n) for n in middle], [key(n) for n in self.nodes[b]], autojunk=False)
            for i, j, size in matcher.get_matching_blocks():
                for k in range(size):
                    self.middle_of[self.nodes[b][j + k]] = middle[i + k]
                    self.in_block[b][middle[i + k]] = self.nodes[b][j + k]
        if not middle:
            raise NotComposable("the middle block makes no node")

    def block_of_name(self, name: str) -> int | None:
        return _block_of_name(name, self.prefix)

    def _tag(self, node) -> int | None:
        return own_block(node, self.prefix)

    def _read_from(self, node, own: set) -> int | None:
        """A node of no block's own: in the block of what it reads (one list element of a foreach
        op's result: that element's block), unless what it reads is a value a block hands on."""
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and isinstance(node.args[0].meta.get("val"), (list, tuple)):
            elements = self.list_blocks(node.args[0])
            return elements[node.args[1]] if elements is not None else None
        if any(isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a) for a in node.args):
            return None  # a foreach op: it reads every block
        blocks = set()
        for a in node.all_input_nodes:
            b = self.of.get(a)
            if b is not None and (a not in own or (a in self.middle_of and self._read_outside[self.middle_of[a]])):
                blocks.add(b)
        return blocks.pop() if len(blocks) == 1 else None

    def list_blocks(self, node) -> list | None:
        """The block of each element of a list-valued node's result: those of its first list
        argument of the same length (a foreach op's result follows its input list)."""
        at = list_argument(node)
        return None if at is None else [self.of.get(x) for x in node.args[at]]


def own_block(node, prefix: str) -> int | None:
    """The block (by index in the list `prefix` names, with its dot) `node` is its own node of:
    its backward's (module_calls.annotating_blocks), else its forward's module call; None outside."""
    backward = block_backward_of(node)
    if backward is not None:
        return backward
    call = layer_of(node)
    return _block_of_name(call, prefix) if call is not None else None


def _block_of_name(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    head = name[len(prefix) :].split(".")[0]
    return int(head) if head.isdigit() else None


def list_argument(node) -> int | None:
    """Which argument of a list-valued node its result follows, element for element: its first
    list of nodes of the same length (a foreach op's); None where there is none."""
    val = node.meta.get("val")
    if not isinstance(val, (list, tuple)):
        return None
    for i, a in enumerate(node.args):
        if isinstance(a, (list, tuple)) and len(a) == len(val) and all(isinstance(x, torch.fx.Node) for x in a):
            return i
    return None


def stamp(gm: torch.fx.GraphModule, slots: list[dict], blocks: str, depth: int, shared: dict | None = None) -> tuple[torch.fx.GraphModule, list[dict]]:
    """The graph (and slots) of the model with `depth` blocks, from `gm`, the graph of the model cut
    to KEEP blocks (traced under module_calls.annotating_blocks(`blocks`)). `shared`: kept between
    stamps of one `gm` at several depths, whose middle blocks then hold the same values (a middle
    block's storages are the same at every depth; the passes never change a value). Raises
    NotComposable."""
    shared = shared if shared is not None else {}
    if "layers" not in shared:  # what the cut graph's nodes are: the same at every depth
        shared["layers"] = _Layers(gm.graph, slots, blocks)
    return _Stamper(gm, slots, shared["layers"], depth, shared).run()


class _Stamper:
    """Builds the deep graph: block 0 and the nodes of no block once, the middle block (1) once per
    block 1 .. depth-2, the last block (KEEP-1) once as block depth-1, in the order a trace of the
    deep model makes them (`_deep_order`: a run of the middle block's nodes ascending where block
    0's counterparts come before it, as in the forward, descending where the last block's do, as in
    the backward and the gradients' reductions it orders)."""

    def __init__(self, gm, slots, layers: _Layers, depth: int, shared: dict):
        self.gm, self.slots, self.layers, self.depth, self.shared = gm, slots, layers, depth, shared
        self.graph = torch.fx.Graph()
        self.made: dict[tuple, torch.fx.Node] = {}  # (node, block) -> its copy in the deep graph
        self.storages: dict[tuple, object] = shared.setdefault("storages", {})  # (storage key, block) -> a middle block's storage
        self.values: dict[tuple, torch.Tensor] = shared.setdefault("values", {})  # (id of a cut value, block) -> its copy there
        self.keys: dict[int, Any] = shared.setdefault("keys", {})  # id of a cut value -> its storage_key (a weak reference made once)
        self.owner: dict = {}  # storage key -> the first node holding it
        self.new_slots: list[dict] = []
        self.calls: dict[tuple, int] = {}  # (block instance, call number) -> renumbered call
        self.fake_mode: Any = None  # the fake tensors' mode, where the copies' values are made
        self.rerun: set = set()  # nodes of no block whose value was made again (it follows the depth)

    def run(self):
        nodes = list(self.gm.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        placeholders = {n: s for n, s in zip([n for n in nodes if n.op == "placeholder"], self.slots)}
        if "owner" not in self.shared:  # the cut graph's: the same at every depth
            for node in nodes:
                for t in _tensors(node.meta.get("val")):
                    self.owner.setdefault(self._key(t), node)
                    if self.fake_mode is None:
                        self.fake_mode = torch._guards.detect_fake_mode([t])
            self.shared["owner"] = (self.owner, self.fake_mode)
        self.owner, self.fake_mode = self.shared["owner"]
        blocks = [self.layers.of[n] for n in nodes]
        for k, block in self._deep_order(blocks, lambda i: self._descending(nodes[i], order)):
            self._emit(nodes[k], block, placeholders.get(nodes[k]))
        from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

        with _use_lazy_graph_module(True):  # as aot.plan.pricing.trace_for_pricing: no Python code made
            return _make_graph_module(self.gm, self.graph), self.new_slots

    def _descending(self, node, order: dict) -> bool:
        """Whether the run of the middle block's nodes starting at `node` goes deep blocks first:
        the last block's counterpart comes before it, or the first block's after it."""
        last, first = self.layers.in_block[KEEP - 1].get(node), self.layers.in_block[0].get(node)
        if last is not None:
            return order[last] < order[node]
        if first is not None:
            return order[first] > order[node]
        raise NotComposable(f"{node.name} of the middle block is in neither the first block nor the last")

    def _block(self, node) -> int | None:
        """The deep graph's block of a node outside the middle block."""
        b = self.layers.of[node]
        return None if b is None else (0 if b == 0 else self.depth - 1)

    def _instance(self, node, block: int | None):
        """The deep graph's copy of `node` (a node of the cut graph) made for `block`."""
        return self.made[(node, block)]

    def _ref(self, a: torch.fx.Node, node_block: int | None, node_layer: int | None) -> torch.fx.Node:
        """What an argument `a` of a node (of cut block `node_layer`, emitted as deep block
        `node_block`) reads in the deep graph: the same relative block."""
        la = self.layers.of[a]
        if la is None:
            return self._instance(a, None)
        if node_layer is None:
            if la == 1:
                raise NotComposable(f"{a.name} of the middle block is read outside the blocks other than in a list")
            return self._instance(a, self._block(a))
        assert node_block is not None  # a node of a block is made for a block
        target = node_block + (la - node_layer)
        if target == self._block(a) and la != 1:
            return self._instance(a, target)
        return self._instance(self._counterpart(a, target), target)

    def _counterpart(self, a, block: int):
        """The cut graph's node whose copy for deep block `block` is `a`'s counterpart there."""
        middle = self.layers.middle_of.get(a)
        if middle is None:
            raise NotComposable(f"{a.name}, a node only the first or last block has, is read by another block")
        if not 0 <= block < self.depth:
            raise NotComposable("a block reads a block beyond the first or the last")
        found = self.layers.in_block[0 if block == 0 else KEEP - 1 if block == self.depth - 1 else 1].get(middle)
        if found is None:
            raise NotComposable(f"{a.name} has no counterpart in the block that reads it")
        return found

    def _deep_order(self, blocks: list, descending: Callable[[int], bool] | None = None) -> list[tuple[int, int | None]]:
        """The deep graph's sequence of a cut sequence (the graph's nodes, or a list over every
        block such as a foreach op's parameters) whose items are in `blocks`: [(cut index, deep
        block)], each run of the middle block's items once per middle block, deep blocks first
        where `descending(start of the run)` (for a list: where the last block's items come first)."""
        descending = descending or (lambda i: (KEEP - 1) in blocks[:i])
        out: list[tuple[int, int | None]] = []
        i = 0
        while i < len(blocks):
            if blocks[i] != 1:
                out.append((i, None if blocks[i] is None else 0 if blocks[i] == 0 else self.depth - 1))
                i += 1
                continue
            j = i
            while j < len(blocks) and blocks[j] == 1:
                j += 1
            middle = range(1, self.depth - 1)
            out += [(k, b) for b in (reversed(middle) if descending(i) else middle) for k in range(i, j)]
            i = j
        return out

    def _args(self, value, node_block, node_layer):
        if isinstance(value, torch.fx.Node):
            return self._ref(value, node_block, node_layer)
        if isinstance(value, (list, tuple)):
            if node_layer is None and any(isinstance(x, torch.fx.Node) and self.layers.of[x] == 1 for x in value):
                blocks = [self.layers.of[x] if isinstance(x, torch.fx.Node) else None for x in value]
                return type(value)(self._instance(value[k], b) if isinstance(value[k], torch.fx.Node) else value[k] for k, b in self._deep_order(blocks))
            return type(value)(self._args(x, node_block, node_layer) for x in value)
        if isinstance(value, dict):
            return {k: self._args(v, node_block, node_layer) for k, v in value.items()}
        return value

    def _expanded_index(self, source: torch.fx.Node, index: int, block: int | None) -> int:
        """The index, in the deep graph's result of list-valued `source`, of its cut element `index` for `block`."""
        for position, (k, b) in enumerate(self._deep_order(self.layers.list_blocks(source) or [])):
            if k == index and (block is None or b == block):
                return position
        raise NotComposable(f"{source.name}[{index}] reads past its list")

    def _emit(self, node, block: int | None, slot: dict | None) -> None:
        layer = self.layers.of[node]
        if node.op == "placeholder":
            new = self.graph.placeholder(f"{node.target}_b{block}" if layer == 1 and block != 1 else node.target)
            self.new_slots.append(self._slot(slot, block) if slot is not None else {})
        elif node.op == "output":
            new = self.graph.output(self._args(node.args[0], block, layer))
        elif node.op == "get_attr":
            new = self.graph.get_attr(node.target)
        else:
            args = self._args(node.args, block, layer)
            if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and self.layers.list_blocks(node.args[0]) is not None:
                source = node.args[0]
                args = (args[0], self._expanded_index(source, node.args[1], block if layer == 1 else None))
            new = self.graph.create_node(node.op, node.target, args, self._args(node.kwargs, block, layer), name=node.name)
        new.meta = dict(node.meta)
        self._relabel(new, layer, block)
        if layer is not None:  # which block it is, for whatever reads the graph after the passes (aot.plan.step_synthesis)
            new.meta["custom"] = {**new.meta.get("custom", {}), STAMPED_BLOCK: block}
        if "val" in node.meta:
            new.meta["val"] = self._deep_val(node, new, layer, block)
        self.made[(node, block)] = new

    def _deep_val(self, node, new, layer, block):
        """The value `new` holds: an op over lists of every block's tensors (a foreach op, the
        stack of their norms) run again on fake tensors, since its result's length or shape follows
        the depth; an element of such a result taken from it; anything else `_val`."""
        source = new.args[0] if node.target is operator.getitem and new.args else None
        if isinstance(source, torch.fx.Node) and node.args[0] in self.rerun:
            return source.meta["val"][new.args[1]]
        if node.op == "call_function" and layer is None and (self._reads_every_block(node) or any(a in self.rerun for a in node.all_input_nodes)):
            self.rerun.add(node)
            if node.meta["val"] is None:  # an in-place foreach op (the optimizer's): nothing to make
                return None
            listed = self._listed_val(node, new)
            if listed is not None:
                return listed
            read = lambda v: torch.fx.node.map_arg(v, lambda a: a.meta.get("val"))  # noqa: E731
            with self.fake_mode:
                return node.target(*read(new.args), **read(new.kwargs))
        return self._val(node, node.meta["val"], layer, block)

    def _listed_val(self, node, new) -> list | tuple | None:
        """The value of a foreach op's copy (an element per element of its list argument), made
        from the cut graph's elements without running the op again on fake tensors (the
        optimizer's ops over every parameter: about a tenth of a stamp's time): each element the
        shape of the cut's for its block, in a storage of its own, or in its input element's where
        the cut's element lives in its input element's. None where the value is not such a list."""
        val, at = node.meta.get("val"), list_argument(node)
        if at is None or not all(isinstance(t, torch.Tensor) for t in val) or not isinstance(new.args[at], (list, tuple)):
            return None
        cut_inputs, deep_inputs = node.args[at], new.args[at]
        order = self._deep_order([self.layers.of.get(x) for x in cut_inputs])
        if len(order) != len(deep_inputs):
            return None
        out = []
        for (k, _), deep_input in zip(order, deep_inputs):
            element, cut_input = val[k], cut_inputs[k].meta.get("val")
            if not isinstance(cut_input, torch.Tensor) or not isinstance(deep_input.meta.get("val"), torch.Tensor):
                return None
            if self._key(element) == self._key(cut_input):
                storage = deep_input.meta["val"].untyped_storage()
            elif self.owner.get(self._key(element)) is node:  # made by the op: a new storage, as running it makes
                storage = torch.empty(element.untyped_storage().nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
            else:
                return None
            out.append(fake_in_storage(element, storage, self.fake_mode))
        return type(val)(out)

    def _key(self, t: torch.Tensor):
        """storage_key of a value of the cut graph (a weak reference to its storage), made once for every depth."""
        key = self.keys.get(id(t))
        if key is None:
            key = self.keys[id(t)] = storage_key(t)
        return key

    def _reads_every_block(self, node) -> bool:
        lists = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (list, tuple))]
        return any(isinstance(x, torch.fx.Node) and self.layers.of[x] == 1 for a in lists for x in a)

    def _slot(self, slot: dict, block: int | None) -> dict:
        name = slot.get("name")
        if name is None or block is None:
            return dict(slot)
        rest = name[len(self.layers.prefix) :].split(".", 1)[1]
        return {**slot, "name": f"{self.layers.prefix}{block}.{rest}"}

    def _relabel(self, new, layer, block) -> None:
        """Module-call names and call numbers, checkpoint calls and the backward's block of a copy,
        as a trace of the deep model writes them (each call its own number)."""
        custom = dict(new.meta.get("custom", {}))
        if not custom:
            return
        instance = block if layer is not None else None
        if MODULE_CALLS in custom:
            calls = []
            for name, number in custom[MODULE_CALLS]:
                b = self.layers.block_of_name(name)
                if b is not None and block is not None:
                    name = f"{self.layers.prefix}{block}{name[len(self.layers.prefix) + len(str(b)) :]}"
                calls.append((name, self.calls.setdefault((instance, "m", number), len(self.calls))))
            custom[MODULE_CALLS] = tuple(calls)
        if CHECKPOINT_CALLS in custom:
            custom[CHECKPOINT_CALLS] = tuple(self.calls.setdefault((instance, "c", n), len(self.calls)) for n in custom[CHECKPOINT_CALLS])
        if BLOCK_BACKWARD in custom and block is not None:
            custom[BLOCK_BACKWARD] = block
        new.meta["custom"] = custom

    def _val(self, node, val, layer, block):
        """The value a copy holds: the same shapes, in the storages of its own block (a storage
        made in the middle block is made again for each of its copies)."""
        if isinstance(val, (list, tuple)):
            return type(val)(self._val(node, x, layer, block) for x in val)
        if not isinstance(val, torch.Tensor):
            return val
        key = self._key(val)
        owner = self.owner.get(key)
        owner_layer = self.layers.of.get(owner) if owner is not None else None
        if owner_layer is None:
            return val  # a storage of no block (a buffer, the batch, the head's values)
        if layer is None:
            if owner_layer == 1:
                raise NotComposable(f"{node.name} outside the blocks holds a value of the middle block")
            return val
        target = block + (owner_layer - layer)
        made = self.values.get((id(val), target)) if self._middle(target) else None
        if made is not None:  # in a storage of self.storages: the same value at every depth (made at a shallower one)
            return made
        storage = self._storage(owner, key, target)
        if storage is None:
            return val
        if not self._middle(target):  # made without the fake mode's dispatch, for the tens of thousands of values a deep model's copies hold
            return fake_in_storage(val, storage, self.fake_mode)
        made = self.values[(id(val), target)] = fake_in_storage(val, storage, self.fake_mode)
        return made

    def _middle(self, block: int) -> bool:
        """Whether `block` holds storages of its own (`_storage`): a middle block but the cut's own."""
        return 0 < block < self.depth - 1 and block != 1

    def _storage(self, owner, key, block: int):
        """The deep graph's storage made by `owner`'s counterpart in `block` (None: the cut
        graph's own, `key`)."""
        if block == self._block(owner) and self.layers.of[owner] != 1:
            return None
        counterpart = self._counterpart(owner, block)
        index = [self._key(t) for t in _tensors(owner.meta.get("val"))].index(key)
        tensor = _tensors(counterpart.meta.get("val"))[index]
        if self._middle(block):
            made = self.storages.get((self._key(tensor), block))
            if made is None:
                made = torch.empty(tensor.untyped_storage().nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
                self.storages[(self._key(tensor), block)] = made
            return made
        return None if self._key(tensor) == key else tensor.untyped_storage()


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []
