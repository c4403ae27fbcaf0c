"""A deep model's step written out from the same step at two shallow depths, without a graph of
the deep one (issue #42; the design is docs/notes/stepgraph-composition.md).

A decoder's blocks repeat, and so does what the passes make of them: the step of a model with L
blocks is, record for record (aot.plan.step_reading.NodeRecord), the step with BASE blocks with
its middle block (`repeated_block`) written out L - BASE + 1 times. Pricing then costs what a shallow model's
graph costs, whatever the depth: no graph of L blocks is stamped, passed over or read.

Every record of the shallow step is tagged with its block (`tag`): placeholders by the name of
the parameter they hold, the forward by its module calls, the backward by the block whose
backward made it (aot.capture.module_calls), anything else by the one block it reads (a
parameter's gather, a gradient's reduction, per-parameter optimizer math), or none. Then:

- **Order.** Each record follows the record that precedes it in the shallow step, taken at the
  same offset in blocks: a record of block b that follows one of block b - 1 follows, in the deep
  step, the counterpart of that one in the block before its own (counterparts: the records at
  the same place in two blocks, whose records must be alike one for one). So runs repeat in
  ascending order in the forward, descending in the backward, and interleaved where a pass put
  one block's gather among the block before's compute, with no rule for each.
- **Reads and storages** at the same offset in blocks; a record of no block reading the repeated
  block (a foreach op's list, the stack of gradient norms) reads every copy of it.
- **Records of no block** that grow with depth (a foreach op over every parameter, the norms'
  stack) are the base step's, with every figure that differs from the step one block shallower
  (`before`) extended along that line.

A step whose first blocks differ from the rest (a recomputing variant that checkpoints the first
k layers: aot/plan/variant_budgets.py) is written out the same way with its base k blocks deeper
(the repeated block is always the third from the last), or where k is large in two passes
(`synthesize_two`): the rest along its repeated block at two counts of first blocks, then the
first region along its block 2 from those two.

`synthesize` trusts nothing: ModelSteps writes out the step one block deeper than the base and
compares it with the real one (`same_step`), and prices the model whole where they differ or
where the rules above do not apply (NotSynthesizable).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, replace

import torch

from aot.capture.module_calls import STAMPED_BLOCK, block_backward_of, layer_of
from aot.plan.cost_model import StepGraph
from aot.plan.step_reading import NodeRecord, assemble, read

BASE = 5  # blocks of the step the deep one is written out from: the first, three alike, the last


def repeated_block(depth: int) -> int:
    """The block written out of a base step of `depth` blocks: the third from the last, so that
    its neighbours are middle blocks too. A deeper base than BASE has blocks before those that
    differ from them (the first blocks checkpointed: aot.plan.variant_budgets), each written once."""
    return depth - 3


class NotSynthesizable(Exception):
    """The deep step cannot be written out from the shallow ones (the message says why)."""


@dataclass
class Tagged:
    """A shallow step's records, each with its block (None: none), and the block of each storage."""

    records: list[NodeRecord]
    tags: list[int | None]
    key_tags: dict  # storage key -> the block its value belongs to
    depth: int


def tag(gm: torch.fx.GraphModule, slots: list[dict], aliases: dict | None, blocks: str, depth: int) -> Tagged:
    """The records of `gm`, the step of the model with `depth` of its blocks `blocks` (a dotted
    name), tagged (see the module docstring)."""
    prefix = blocks + "."

    def block_of_name(name: str | None) -> int | None:
        if not name or not name.startswith(prefix):
            return None
        head = name[len(prefix) :].split(".")[0]
        return int(head) if head.isdigit() else None

    nodes = list(gm.graph.nodes)
    records = read(gm, slots, aliases)
    # a block's own nodes first: its forward (module calls) and its backward
    of: dict = {n: _own_block(n, block_of_name) for n in nodes}
    for node, slot in zip([n for n in nodes if n.op == "placeholder"], slots):
        # a tensor registered in one block but read by several (a shared buffer) is in none
        block = block_of_name(slot.get("name"))
        of[node] = block if {of[u] for u in node.users} - {None} <= {block} else None
    elements: dict = {}  # a list-valued node of no block -> its elements' blocks
    for node in nodes:
        if node.op == "placeholder" or of[node] is not None:
            continue
        lists = [a for a in node.args if isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a)]
        source = node.args[0] if node.args else None
        block = None
        if node.target is operator.getitem and isinstance(source, torch.fx.Node) and source in elements:
            block = elements[source][node.args[1]]  # an element of a foreach op's result
        elif lists:
            val = node.meta.get("val")
            if isinstance(val, (list, tuple)):
                same = next((a for a in lists if len(a) == len(val)), None)
                elements[node] = [of.get(x) if isinstance(x, torch.fx.Node) else None for x in same] if same is not None else [None] * len(val)
        else:  # the one block it reads (a parameter's gather, a gradient's reduction, optimizer math)
            read_from = {of[a] for a in node.all_input_nodes} - {None}
            block = read_from.pop() if len(read_from) == 1 else None
        of[node] = block
    for node, after in reversed(list(zip(nodes, nodes[1:]))):
        if node.op == "call_function" and not node.all_input_nodes and of[node] is None:
            # a factory reading nothing (tp's `empty` per weight): with the one block that reads
            # it, else with what follows it
            readers = {of[u] for u in node.users} - {None}
            of[node] = readers.pop() if len(readers) == 1 else of[after]
    tags = [of[n] for n in nodes]
    key_tags: dict = {}
    for node, record, block in zip(nodes, records, tags):
        per_value = elements.get(node)
        for k, key in enumerate(record.keys):
            if key not in key_tags:
                key_tags[key] = per_value[k] if per_value is not None and k < len(per_value) else block
    return Tagged(records, tags, key_tags, depth)


def synthesize(base: Tagged, before: Tagged, depth: int) -> StepGraph:
    """The step of the model with `depth` blocks, from its steps with base.depth (at least BASE)
    blocks and one fewer (`before`), whose block repeated_block(base.depth) is the one written out.
    Raises NotSynthesizable."""
    return assemble(_Writer(base, before, depth).tagged(keys=False).records)


LEADING = 5  # the first blocks (alike among themselves) of the base of a step written out in two regions


def synthesize_two(shallow: dict[tuple[int, int], Tagged], first: int, rest: int) -> StepGraph:
    """The step of a model whose first `first` blocks differ from the `rest` after them (the first
    ones checkpointed: aot.plan.variant_budgets), each region's blocks alike among themselves,
    from its steps with (a, b) blocks in the two regions for a in (LEADING - 1, LEADING) and b in
    (BASE - 1, BASE), `shallow`: the rest written out first (its repeated block, as `synthesize`'s),
    then the first region (along its block 2). Raises NotSynthesizable."""
    a, b = LEADING, BASE
    if first < a or rest < b:
        raise NotSynthesizable(f"two regions of at least {a} and {b} blocks")
    written = {k: _Writer(shallow[(k, b)], shallow[(k, b - 1)], k + rest).tagged() for k in (a - 1, a)}
    return assemble(_Writer(written[a], written[a - 1], first + rest, repeated=2).tagged(keys=False).records)


def same_step(a: StepGraph, b: StepGraph) -> str | None:
    """Where two steps differ for the cost model (names aside), or None if they do not."""

    def ops(s: StepGraph):
        return [(o.target, o.kind, o.dtype, o.flops, o.bytes, o.elements, o.launches, sorted(o.tensors)) for o in s.ops]

    def comms(s: StepGraph):
        return [(c.kind, c.group, c.bytes, c.input_bytes, c.dtype, c.issue_at, c.wait_at, c.group_size, c.readers, c.buffers) for c in s.comms]

    if a.graph_nodes != b.graph_nodes:
        return f"{a.graph_nodes} nodes, not {b.graph_nodes}"
    if ops(a) != ops(b):
        return "the ops differ"
    if comms(a) != comms(b):
        return "the collectives differ"
    if (a.memory.resident_tensors, a.memory.intervals) != (b.memory.resident_tensors, b.memory.intervals):
        return "the memory differs"
    return None


class _Writer:
    """synthesize's work: the deep step's records, each a handle (shallow record, copy) where
    copy is the deep block of a copy of the repeated block and None for every other record."""

    def __init__(self, base: Tagged, before: Tagged, depth: int, repeated: int | None = None):
        n = base.depth
        if n < BASE or before.depth != n - 1 or depth < n:
            raise NotSynthesizable(f"written out from {n} and {n - 1} blocks (at least {BASE}) to at least {n}")
        self.base, self.depth = base, depth
        self.repeated = r = repeated_block(n) if repeated is None else repeated
        self.extra = depth - n  # copies beyond the base's one
        self.copies = range(r, r + self.extra + 1)
        tags = base.tags
        self.sequence: list[list[int]] = [[] for _ in range(n)]  # each block's records, in order
        for i, t in enumerate(tags):
            if t is not None:
                if not 0 <= t < n:
                    raise NotSynthesizable(f"a record of block {t} in a step of {n}")
                self.sequence[t].append(i)
        self.place = {i: k for seq in self.sequence for k, i in enumerate(seq)}
        shape = lambda seq: [_signature(base.records[i]) for i in seq]  # noqa: E731
        middle = shape(self.sequence[r])
        self.alike = [shape(seq) == middle for seq in self.sequence]
        if not all(self.alike[r - 1 : r + 2]):
            raise NotSynthesizable("the middle blocks' records differ")
        self.owner: dict = {}  # storage key -> (first record holding it, its place in that record's value)
        for i, record in enumerate(base.records):
            for k, key in enumerate(record.keys):
                self.owner.setdefault(key, (i, k))
        self.grown = _grown(base, before, self.extra)
        self._counterparts: dict = {}

    # -- blocks ----------------------------------------------------------------------------------

    def deep_block(self, t: int) -> int:
        """The deep block of shallow block `t` (not the repeated one)."""
        return t if t < self.repeated else t + self.extra

    def shallow_block(self, e: int) -> int:
        if not 0 <= e < self.depth:
            raise NotSynthesizable("a block reads a block beyond the first or the last")
        return e if e < self.repeated else self.repeated if e <= self.repeated + self.extra else e - self.extra

    def block_of(self, handle) -> int | None:
        i, copy = handle
        return copy if copy is not None else (None if self.base.tags[i] is None else self.deep_block(self.base.tags[i]))

    def counterpart(self, i: int, block: int) -> int:
        t = self.base.tags[i]
        if t == block:
            return i
        found = self._counterparts.get((i, block))
        if found is None:
            found = self._counterparts[(i, block)] = self._counterpart(i, block)
        return found

    def _counterpart(self, i: int, block: int) -> int:
        t = self.base.tags[i]
        assert t is not None  # only a record of a block has counterparts
        if not (self.alike[t] and self.alike[block]):
            raise NotSynthesizable("a block reads a record of the first or last block that the middle ones lack")
        return self.sequence[block][self.place[i]]

    def at(self, i: int, e: int):
        """The handle of shallow record `i`'s counterpart in deep block `e`."""
        s = self.shallow_block(e)
        j = self.counterpart(i, s)
        return (j, e) if s == self.repeated else (j, None)

    def relative(self, handle, i: int):
        """What deep record `handle` takes for shallow record `i` it reads or follows: the same
        offset in blocks; `i` itself where either is of no block."""
        mine, t = self.base.tags[handle[0]], self.base.tags[i]
        if t is None:
            return (i, None)
        if mine is None:
            if t == self.repeated:
                raise NotSynthesizable("a record of no block reads one copy of the repeated block")
            return (i, None)
        block = self.block_of(handle)
        assert block is not None  # a record of a block is in a deep block
        try:
            return self.at(i, block + t - mine)
        except NotSynthesizable:
            if handle[1] is not None or t == self.repeated:
                raise
            return (i, None)  # two blocks written once (the first's and the last's): each other's, whatever the depth

    # -- the deep step -----------------------------------------------------------------------------

    def handles(self) -> list:
        tags = self.base.tags
        return [(i, e) for i, t in enumerate(tags) for e in (self.copies if t == self.repeated else [None])]

    def order(self) -> list:
        """The deep step's handles in order: each after the deep counterpart of what precedes it."""
        after: dict = {}
        every = self.handles()
        tags = self.base.tags
        for handle in every:
            i = handle[0]
            if i == 0:
                if tags[0] == self.repeated:
                    raise NotSynthesizable("the step starts in the repeated block")
                continue
            if tags[i] == self.repeated and tags[i - 1] is None:
                raise NotSynthesizable("a run of the repeated block follows a record of no block")
            if tags[i] is None and tags[i - 1] == self.repeated:
                raise NotSynthesizable("a record of no block follows the repeated block")
            anchor = self.relative(handle, i - 1)
            if anchor in after:
                raise NotSynthesizable("two records follow one")
            after[anchor] = handle
        out = [(0, None)]
        while out[-1] in after:
            out.append(after.pop(out[-1]))
        if len(out) != len(every):
            raise NotSynthesizable("the order does not chain")
        return out

    def tagged(self, keys: bool = True) -> Tagged:
        """The deep step's records, tagged with their deep blocks, and (`keys`) the deep block of
        each storage: what writing it out again along another repeated block needs
        (`synthesize_two`)."""
        order = self.order()
        position = {h: k for k, h in enumerate(order)}
        base = self.base
        out: list[NodeRecord] = []
        key_tags: dict = {}
        for handle in order:
            i, copy = handle
            r = base.records[i]
            inputs: list[int] = []
            for a in r.inputs:
                for h in self.reads(handle, a):
                    inputs.append(position[h])
            storage_keys, sizes, blocks = self.storages(handle) if r.keys else ((), (), ())
            if keys:
                for key, block in zip(storage_keys, blocks):
                    key_tags.setdefault(key, block)
            source = position[self.reads(handle, r.source)[0]] if r.source is not None else None
            new = NodeRecord(r.kind, tuple(inputs), storage_keys, sizes, r.part, r.op, r.comm, source, r.loss)
            if i in self.grown:
                new = self.grown[i](new)
            if copy is not None and r.comm is not None:
                new.comm = replace(r.comm, name=f"{r.comm.name}@{copy}")
            out.append(new)
        return Tagged(out, [self.block_of(h) for h in order], key_tags, self.depth)

    def reads(self, handle, a: int) -> list:
        """The deep handles deep record `handle` reads for shallow input `a`."""
        tags = self.base.tags
        mine = tags[handle[0]]
        if mine is None and tags[a] == self.repeated:
            return [(a, e) for e in self.copies]
        if handle[1] is not None and tags[a] == mine:  # a copy of the repeated block reads its own record: that copy's (`relative`'s)
            return [(a, handle[1])]
        return [self.relative(handle, a)]

    def storages(self, handle) -> tuple[tuple, tuple, tuple]:
        """The deep record's value: its storages, their sizes and the deep block of each (None: none)."""
        i, _ = handle
        r = self.base.records[i]
        mine = self.base.tags[i]
        if mine is None:  # a list over every block: each copy's elements, a run of them per copy
            tags = [self.base.key_tags.get(key) for key in r.keys]
            expanded = _runs(list(zip(r.keys, r.sizes)), tags, self.copies, self.repeated)
            keys = tuple(key if e is None else (key, e) for (key, _), e in expanded)
            blocks = tuple(e if e is not None else self._deep_or_none(self.base.key_tags.get(key)) for (key, _), e in expanded)
            return keys, tuple(size for (_, size), _ in expanded), blocks
        copy, key_tags = handle[1], self.base.key_tags
        pairs = [
            (key, None)
            if (t := key_tags.get(key)) is None
            else ((key, copy), copy)  # a copy of the repeated block holds that copy's storages of its own block (`deep_key`'s)
            if copy is not None and t == mine
            else self.deep_key(handle, key, t)
            for key in r.keys
        ]
        return tuple(k for k, _ in pairs), r.sizes, tuple(b for _, b in pairs)

    def _deep_or_none(self, t: int | None) -> int | None:
        return None if t is None else self.deep_block(t)

    def deep_key(self, handle, key, t: int) -> tuple:
        """(the deep storage key, its deep block) of `key` of block `t`, as deep record `handle` holds it."""
        block = self.block_of(handle)
        assert block is not None and self.base.tags[handle[0]] is not None  # a record of a block
        e = block + t - self.base.tags[handle[0]]
        s = self.shallow_block(e)
        if s != t:
            owner, k = self.owner[key]
            if self.base.tags[owner] != t:
                raise NotSynthesizable("a block reads an element of another block's list")
            key = self.base.records[self.counterpart(owner, s)].keys[k]
        return ((key, e) if s == self.repeated else key), e


def _runs(items: list, tags: list, copies: range, repeated: int) -> list:
    """[(item, copy)] of a list over every block (a foreach op's), its run of the repeated block's
    items written once per copy (copy None: the item as it is), deepest first where a later
    block's items come before the run (the backward's order), as a deep model's list has them."""
    out: list = []
    k = 0
    while k < len(items):
        if tags[k] != repeated:
            out.append((items[k], None))
            k += 1
            continue
        end = k
        while end < len(tags) and tags[end] == repeated:
            end += 1
        descending = any(t is not None and t > repeated for t in tags[:k])
        out += [(item, e) for e in (reversed(copies) if descending else copies) for item in items[k:end]]
        k = end
    return out


def _own_block(node, block_of_name) -> int | None:
    """The block whose forward (module calls) or backward made `node`; None for any other node."""
    if node.op != "call_function":
        return None
    stamped = node.meta.get("custom", {}).get(STAMPED_BLOCK)
    if stamped is not None:
        return stamped
    backward = block_backward_of(node)
    return backward if backward is not None else block_of_name(layer_of(node))


def _signature(r: NodeRecord) -> tuple:
    return (r.kind, r.op.target if r.op is not None else r.comm.kind if r.comm is not None else None, len(r.inputs), len(r.keys))


def _grown(base: Tagged, before: Tagged, extra: int) -> dict:
    """For each record of no block of `base` whose figures differ from its counterpart one block
    shallower (`before`), a function extending them `extra` blocks further along that line."""
    mine = [i for i, t in enumerate(base.tags) if t is None]
    theirs = [i for i, t in enumerate(before.tags) if t is None]
    if len(mine) != len(theirs):
        raise NotSynthesizable(f"{len(mine)} records of no block, {len(theirs)} one block shallower")
    out = {}
    for i, j in zip(mine, theirs):
        a, b = before.records[j], base.records[i]
        if (a.kind, a.op.target if a.op else None) != (b.kind, b.op.target if b.op else None):
            raise NotSynthesizable("the records of no block differ one block shallower")
        grow = _line(a, b, extra)
        if grow is not None:
            out[i] = grow
    return out


def _line(a: NodeRecord, b: NodeRecord, extra: int):
    """How record `b` grows `extra` blocks on from `a` (one block shallower); None where it does not."""
    ext = lambda x, y: y + extra * (y - x)  # noqa: E731
    op = None
    if a.op is not None and b.op is not None and a.op != replace(b.op, name=a.op.name):
        tensors = _extended(a.op.tensors, b.op.tensors, extra)
        op = replace(
            b.op,
            flops=ext(a.op.flops, b.op.flops),
            bytes=ext(a.op.bytes, b.op.bytes),
            elements=ext(a.op.elements, b.op.elements),
            launches=ext(a.op.launches, b.op.launches),
            tensors=tensors,
        )
    comm = None
    if a.comm is not None and b.comm is not None and a.comm.input_numel != b.comm.input_numel:
        comm = replace(b.comm, input_numel=ext(a.comm.input_numel, b.comm.input_numel)).sized(b.comm.element_size)
    sizes = None
    if len(a.sizes) == len(b.sizes) and a.sizes != b.sizes:
        sizes = tuple(tuple(ext(x, y) for x, y in zip(p, q)) for p, q in zip(a.sizes, b.sizes))
    if op is None and comm is None and sizes is None:
        return None

    def grow(r: NodeRecord) -> NodeRecord:
        return replace(r, op=op or r.op, comm=comm or r.comm, sizes=sizes if sizes is not None else r.sizes)

    return grow


def _extended(a: tuple, b: tuple, extra: int) -> tuple:
    """An op's tensors (numel, element size, flat) `extra` blocks on from `b`, which is `a` one
    block deeper: the tensors `b` has beyond `a` added again for each block, and each tensor that
    grew (the stack of every gradient's norm) grown as much again for each."""
    added, removed = Counter(b), Counter(a)
    added.subtract(Counter(a))
    removed.subtract(Counter(b))
    added, removed = +added, +removed
    out = list(b)
    for numel, size, flat in sorted(removed.elements()):
        grown = next((t for t in sorted(added) if added[t] > 0 and t[1:] == (size, flat) and t[0] > numel), None)
        if grown is None:
            raise NotSynthesizable("an op reads other tensors one block shallower")
        added[grown] -= 1
        out.remove(grown)
        out.append((grown[0] + extra * (grown[0] - numel), size, flat))
    return tuple(out) + tuple(t for t, n in added.items() for _ in range(n * extra))
