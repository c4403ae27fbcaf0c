"""Hierarchical all_reduce, analytically: a step graph's all_reduces split in two levels as
aot.passes.hierarchical splits them, so the planner prices a plan as its build will run it without
running the pass (as aot.plan.rebucket does for bucketing).

The pass replaces an all_reduce by a reduce-scatter over the node's ranks, an all_reduce of the
pieces across nodes and an all-gather over the node's ranks, each waited for before the next is
issued (a functional collective takes a waited tensor): once the overlap pass has issued them
early and waited late, the first two are issued and waited where the all_reduce was issued, so
compute stops for them there, and only the all-gather runs beside compute until the all_reduce's
first reader. The buffer is viewed flat and zero-padded to a multiple of the node's ranks before,
and cut back and viewed in its shape after.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from aot.passes.hierarchical import SubGroups
from aot.plan.cost_model import CommSite, Op, StepGraph


def split_levels(step: StepGraph, choose: Callable[[str, int], SubGroups | None] | None) -> StepGraph:
    """`step` with each all_reduce `choose(group, bytes)` names sub-groups for (the build's
    aot.plan.hierarchy.chooser) replaced by its three collectives."""
    if choose is None:
        return step
    comms: list[CommSite] = []
    for c in step.comms:
        levels = choose(c.group, c.input_bytes) if c.kind == "all_reduce" else None
        comms += [c] if levels is None else _three(c, levels)
    if len(comms) == len(step.comms):
        return step
    return replace(step, comms=comms)


def _three(c: CommSite, levels: SubGroups) -> list[CommSite]:
    g, numel, size, dtype = levels.intra_size, c.input_numel, c.element_size, c.dtype
    padded = -(-numel // g) * g
    flat = Op(f"view_{c.name}", "view", kind="view", dtype=dtype)
    shaped = Op(f"view_back_{c.name}", "view", kind="view", dtype=dtype)
    pre, post = [*c.pre_ops, flat], [shaped, *c.post_ops]
    if padded != numel:
        tensors = ((numel, size, True), (padded, size, True))
        pre.append(Op(f"pad_{c.name}", "constant_pad_nd", bytes=float((numel + padded) * size), dtype=dtype, tensors=tensors, elements=padded))
        post.insert(0, Op(f"cut_{c.name}", "slice", kind="view", dtype=dtype))

    def site(suffix: str, kind: str, group: str, n: int, wait_at: int, **more) -> CommSite:
        size_of_group = g if kind != "all_reduce" else 1
        made = CommSite(f"{c.name}_{suffix}", kind, group, 0, 0, dtype, c.issue_at, wait_at, input_numel=n, members=c.members, group_size=size_of_group)
        return replace(made, **more).sized(size)

    return [
        site("intra_scatter", "reduce_scatter", levels.intra, padded, c.issue_at, pre_ops=pre),
        site("inter_reduce", "all_reduce", levels.inter, padded // g, c.issue_at),
        site("intra_gather", "all_gather", levels.intra, padded // g, c.wait_at, post_ops=post, readers=c.readers),
    ]
