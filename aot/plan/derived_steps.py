"""Step graphs of other meshes derived from a traced one, without tracing again: a wider or
narrower fsdp axis (`rescale`: shards and padded whole parameters resized, collectives over the
axis at the new degree) and a mesh without an axis (`drop_group`). aot.plan.model_steps prices
every fsdp degree from one fsdp=2 trace this way; the final pricing is always on the graph as
built.
"""

from __future__ import annotations

from aot.plan.cost_model import CommSite, StepGraph, changed, interval_columns, memory_of


class ShardScale:
    """numel -> numel for a graph traced with fsdp degree `degree_from` re-read at `degree_to`.

    `shard(n)`: a parameter's shard (ceil(numel / degree)) changes size; `full(n)`: a padded whole
    parameter (shard x degree, the reduce-scatter's input) does; calling it tries shard sizes first,
    then padded whole ones (`full_first` the other way round). Every other numel is kept. Only flat (0-d or 1-d) tensors of ops are
    resized, as shards are; a flat tensor that merely has one of those sizes (a bias gathered and
    sliced to its own length) is resized too: an approximation that the final pricing, on the
    graph as built, does not make.
    """

    def __init__(self, param_numels, degree_from: int, degree_to: int):
        self._shard: dict[int, int] = {}
        self._full: dict[int, int] = {}
        for n in sorted(set(param_numels)):
            a, b = -(-n // degree_from), -(-n // degree_to)
            self._shard.setdefault(a, b)
            self._full.setdefault(a * degree_from, b * degree_to)

    def shard(self, numel: int) -> int:
        return self._shard.get(numel, numel)

    def full(self, numel: int) -> int:
        return self._full.get(numel, numel)

    def __call__(self, numel: int) -> int:
        return self._shard[numel] if numel in self._shard else self._full.get(numel, numel)

    def full_first(self, numel: int) -> int:
        return self._full[numel] if numel in self._full else self._shard.get(numel, numel)


def shard_scale(param_numels, degree_from: int, degree_to: int) -> ShardScale:
    return ShardScale(param_numels, degree_from, degree_to)


def rescale(step: StepGraph, scale: ShardScale, group: str, degree: int) -> StepGraph:
    """`step` with its tensors resized by `scale` and collectives over `group` at `degree` ranks:
    the graph of a wider (or narrower) fsdp axis, without tracing it again. Resident parameters and
    optimizer state are shards; a reduce-scatter takes a padded whole gradient; an all_gather (and
    a data-parallel all_reduce of a sharded gradient) takes a shard."""
    # Before the first reduce-scattered gradient is read, flat tensors are whole parameters and
    # gradients (gathered, padded); after it, the optimizer works on shards.
    boundary = min((c.wait_at for c in step.comms if c.kind == "reduce_scatter"), default=len(step.ops))
    ops = list(step.ops)
    flat_ops = _flat_ops(step)
    resized: dict[tuple, tuple] = {}  # (tensors, before the boundary) -> (resized tensors, bytes): a deep step's blocks repeat them
    for i in flat_ops:  # shards and padded whole parameters are flat; shaped tensors keep their size (and the op)
        op = ops[i]
        key = (op.tensors, i < boundary)
        got = resized.get(key)
        if got is None:
            resize = scale.full_first if i < boundary else scale
            tensors = tuple((resize(n) if flat else n, e, flat) for n, e, flat in op.tensors)
            got = resized[key] = (tensors, float(sum(n * e for n, e, _ in tensors)))
        ops[i] = changed(op, tensors=got[0], bytes=got[1])
    comms = []
    for c in step.comms:
        elsize = c.element_size
        resize = scale.full if c.kind == "reduce_scatter" else scale.shard if c.kind == "all_gather" else scale
        c = changed(
            c,
            input_numel=resize(c.input_numel),
            pre_ops=list(c.pre_ops),
            post_ops=list(c.post_ops),
            group_size=degree if c.group == group and c.kind in ("all_gather", "reduce_scatter") else c.group_size,
        )
        comms.append(c.sized(elsize))
    resident = tuple((part, scale.shard(n) if part in ("params", "optimizer") else n, e) for part, n, e in step.memory.resident_tensors)
    memory = memory_of(resident, step.memory.intervals, step.memory.length, scale, interval_columns(step.memory))
    return StepGraph(ops=ops, comms=comms, memory=memory, graph_nodes=step.graph_nodes, resized_from=(step, flat_ops))


def _flat_ops(step: StepGraph) -> list[int]:
    """The indices of `step`'s ops that read or write a flat tensor (those rescale resizes), found
    once per graph: the search rescales one graph to every fsdp degree of every mesh."""
    if step.flat_ops is None:
        step.flat_ops = [i for i, op in enumerate(step.ops) if any(flat for _, _, flat in op.tensors)]
    return step.flat_ops


def drop_group(step: StepGraph, group: str) -> StepGraph:
    """`step` without the collectives over `group` and the ops that only consume their results
    (the averaging division): the graph of a mesh where that axis has degree 1."""
    dropped = [c for c in step.comms if c.group == group]
    gone = {i for c in dropped for i in c.readers if _only_reader(step, i, c)}
    new_index, k = [], 0
    for i in range(len(step.ops) + 1):
        new_index.append(k)
        if i < len(step.ops) and i not in gone:
            k += 1
    ops = [op for i, op in enumerate(step.ops) if i not in gone]
    comms = [
        changed(c, issue_at=new_index[c.issue_at], wait_at=new_index[c.wait_at], readers=tuple(new_index[r] for r in c.readers if r not in gone))
        for c in step.comms
        if c.group != group
    ]
    return StepGraph(ops=ops, comms=comms, memory=step.memory, graph_nodes=step.graph_nodes - 3 * len(dropped))


def _only_reader(step: StepGraph, index: int, site: CommSite) -> bool:
    op = step.ops[index]
    return op.kind == "compute" and op.target in ("div", "mul") and len(site.readers) == 1
