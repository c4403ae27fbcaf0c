"""Bucketing, analytically: a step graph's all_reduces packed as aot.passes.bucketing packs them
(same order, same size rule), so the planner prices candidate bucket sizes without re-tracing."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from aot.plan.cost_model import CommSite, Op, StepGraph, memory_with


def rebucket(step: StepGraph, bucket_bytes: int) -> StepGraph:
    """`step` with its all_reduces packed as aot.passes.bucketing packs them: in the order their
    inputs are produced, per (group, dtype), a new bucket once the open one holds `bucket_bytes`
    or once a member would need another member's result. A bucket is issued when its last member's
    input exists and waited for before its first member's result is read; packing (a view per
    member and a cat) and unpacking (a split and a view per member) are ops of their own.

    Memory is re-timed as the build's passes leave it (`step` analyzed after aot.passes.overlap):
    each member's gradient lives until the bucket is packed, and the bucket from then until the
    last read of any member's result, since the unpacked results are views of it."""
    packing = _packing(step)
    singles = packing.singles
    open_: dict[tuple, list[list[CommSite]]] = {}
    filling: dict[tuple, tuple] = {}  # (group, dtype) -> the open bucket's bytes, latest issue, first wait
    for i in packing.order:
        c = singles[i]
        buckets = open_.setdefault((c.group, c.dtype), [[]])
        b = buckets[-1]
        size, issue, wait = filling.get((c.group, c.dtype), (0, c.issue_at, c.wait_at))
        # aot.passes.bucketing: a new bucket once the open one is full, or once the bucket's inputs
        # would not all exist before the first of its results is read
        if b and (size >= bucket_bytes or max(issue, c.issue_at) > min(wait, c.wait_at)):
            b = []
            buckets.append(b)
            size, issue, wait = 0, c.issue_at, c.wait_at
        b.append(c)
        filling[(c.group, c.dtype)] = (size + c.input_bytes, max(issue, c.issue_at), min(wait, c.wait_at))
    # the build's analysis lists collectives in graph order, and the simulation issues those due at
    # one op in list order: each keeps its place, a bucket its last member's (bucketing packs there)
    place = dict(packing.place)
    comms: list[CommSite] = []  # the single all_reduces and the buckets, merged into packing.others below
    intervals = list(step.memory.intervals)
    changed: dict[int, tuple] = {}
    added: list[tuple] = []
    for buckets in open_.values():
        for b in buckets:
            if len(b) == 1:
                comms.append(b[0])
                continue
            total = sum(m.input_bytes for m in b)
            added += _retime(intervals, b, changed)
            dtype = b[0].dtype
            pre = [op for m in b for op in packing.flattened(m)]
            pre.append(Op(f"cat_{b[0].name}", "cat", bytes=2.0 * total, dtype=dtype))
            post = [Op(f"split_{b[0].name}", "split_with_sizes", kind="view", dtype=dtype)]
            post += [Op(f"unpack_{m.name}", "view", kind="view", dtype=dtype) for m in b]
            site = CommSite(
                f"bucket_{b[0].name}",
                "all_reduce",
                b[0].group,
                total,
                total,
                dtype,
                issue_at=max(m.issue_at for m in b),
                wait_at=min(m.wait_at for m in b),
                members=len(b),
                pre_ops=pre,
                post_ops=post,
                input_numel=sum(m.input_numel for m in b),
                readers=tuple(sorted(r for m in b for r in m.readers)),
            )
            place[id(site)] = max(place[id(m)] for m in b)
            comms.append(site)
    memory = memory_with(step.memory, changed, tuple(added))
    return StepGraph(ops=step.ops, comms=packing.merged(comms, place), memory=memory, graph_nodes=step.graph_nodes, resized_from=step.resized_from)


@dataclass
class _Packing:
    """What rebucket takes from a graph at any bucket size: its single all_reduces in the order
    their inputs are produced, its other collectives, each collective's place in the graph's
    list, and each member's flattening ops (made once: the ops are never changed)."""

    singles: list[CommSite]
    order: list[int]
    others: list[CommSite]  # in the order the simulation issues them: by (issue_at, place)
    place: dict[int, int]
    _flat: dict[int, list[Op]]
    _keys: list[tuple[int, int]]  # others' (issue_at, place)

    def merged(self, comms: list[CommSite], place: dict[int, int]) -> list[CommSite]:
        """`comms` (where `place` places each) among `others`, every collective by (issue_at,
        place): a deep step's thousands of other collectives are in that order once, not sorted
        again at every bucket size (no two collectives share a place, so the order is the sort's)."""
        key = lambda c: (c.issue_at, place[id(c)])  # noqa: E731
        out: list[CommSite] = []
        done = 0
        for c in sorted(comms, key=key):
            at = bisect.bisect_right(self._keys, key(c), lo=done)
            out += self.others[done:at]
            out.append(c)
            done = at
        out += self.others[done:]
        return out

    def flattened(self, member: CommSite) -> list[Op]:
        ops = self._flat.get(id(member))
        if ops is None:
            ops = self._flat[id(member)] = _flattened(member)
        return ops


def _packing(step: StepGraph) -> _Packing:
    if step.packing is None:
        singles = [c for c in step.comms if c.kind == "all_reduce" and c.members == 1]
        others = [c for c in step.comms if not (c.kind == "all_reduce" and c.members == 1)]
        order = sorted(range(len(singles)), key=lambda i: (singles[i].issue_at, i))
        place = {id(c): i for i, c in enumerate(step.comms)}
        others.sort(key=lambda c: (c.issue_at, place[id(c)]))
        step.packing = _Packing(singles, order, others, place, {}, [(c.issue_at, place[id(c)]) for c in others])
    return step.packing


def _flattened(member: CommSite) -> list[Op]:
    """The ops that flatten a member for packing: a view, after a contiguous copy where its input is
    laid out otherwise (aot.passes.bucketing; the copy priced as aot.plan.step_reading prices one)."""
    view = Op(f"view_{member.name}", "view", kind="view", dtype=member.dtype)
    if member.strided_shape is None:
        return [view]
    n, size, flat = member.input_numel, member.element_size, len(member.strided_shape) <= 1
    copy = Op(f"clone_{member.name}", "clone", bytes=2.0 * n * size, dtype=member.dtype, tensors=((n, size, flat), (n, size, flat)), elements=n)
    return [copy, view]


def _retime(intervals: list, bucket: list[CommSite], changed: dict) -> list[tuple]:
    """The storages of `bucket`'s members as one bucket holds them (each change also in `changed`): packed (the cat) once the last
    member's result would have been made, the bucket alive until the last read of any result. The
    bucket stays one interval per member so a rescaled graph's sizes still apply per tensor.

    Where the packing is, the members' inputs stand for the packed bucket (each gradient's last
    read is its copy into it). A member whose input is read after the packing too (the loss,
    averaged with the gradients, is read at the step's end) is in the bucket as a copy of its
    own: the interval of that copy, at the packing, is returned to be added."""
    if any(m.buffers[1] < 0 for m in bucket):
        return []  # a result analyze could not place (not one tensor): priced as traced
    results = [intervals[m.buffers[1]] for m in bucket]
    packed = max(start for start, *_ in results)
    last = max(end for _, end, *_ in results)
    copies = []
    for m, (_, _, *rest) in zip(bucket, results):
        intervals[m.buffers[1]] = changed[m.buffers[1]] = (packed, last, *rest)
        if m.buffers[0] >= 0:
            start, end, *kept = intervals[m.buffers[0]]
            intervals[m.buffers[0]] = changed[m.buffers[0]] = (start, max(end, packed), *kept)
            if end > packed:
                copies.append((packed, packed, *rest))
    return copies
