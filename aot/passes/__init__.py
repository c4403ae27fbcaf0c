"""Graph passes: each a function from an FX graph module to an FX graph module, with its own test.

`PASSES` is the one order they run in, for the build, the pipeline build and the planner alike;
each is free of the others' details, so they compose. A caller that prices part of the work
another way runs a slice of the list (`only=`, `skip=`), never a sequence written out again: the
planner prices bucketing and hierarchical all_reduce analytically (aot/plan/rebucket.py), so it
runs the cleanup when it traces and the scheduling passes when it prices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aot.defaults import DEFAULT_BUCKET_MB
from aot.passes.bucketing import bucket_all_reduces
from aot.passes.cleanup import drop_profiler_calls, plain_collectives
from aot.passes.graph_utils import lint_once
from aot.passes.hierarchical import split_hierarchical
from aot.passes.overlap import issue_early_wait_late
from aot.passes.prefetch import prefetch_parameter_gathers
from aot.passes.regather import regather_in_backward
from aot.passes.repeated_backward import merge_repeated_backward


@dataclass(frozen=True)
class PassOptions:
    """What the passes are told: the gradient bucket size; how many bytes of fsdp gathers run
    ahead (None: one parameter, the build's default); `hierarchical(group, bytes)`, the sub-groups
    to split that all_reduce over, or None (aot.plan.hierarchy.chooser)."""

    bucket_bytes: int = int(DEFAULT_BUCKET_MB * 2**20)
    prefetch_bytes: int | None = None
    hierarchical: Callable | None = None


Pass = Callable[[torch.fx.GraphModule, PassOptions], torch.fx.GraphModule]

# (name, pass), in the order they run
PASSES: tuple[tuple[str, Pass], ...] = (
    ("drop_profiler_calls", lambda gm, o: drop_profiler_calls(gm)),
    ("merge_repeated_backward", lambda gm, o: merge_repeated_backward(gm)),
    ("plain_collectives", lambda gm, o: plain_collectives(gm)),
    ("bucket_all_reduces", lambda gm, o: bucket_all_reduces(gm, o.bucket_bytes)),
    ("split_hierarchical", lambda gm, o: split_hierarchical(gm, o.hierarchical)),
    ("issue_early_wait_late", lambda gm, o: issue_early_wait_late(gm)),
    ("regather_in_backward", lambda gm, o: regather_in_backward(gm)),
    ("prefetch_parameter_gathers", lambda gm, o: prefetch_parameter_gathers(gm, o.prefetch_bytes)),
)
# what a traced step needs before it can be read (priced, derived) at all
CLEANUP = ("drop_profiler_calls", "merge_repeated_backward", "plain_collectives")
# the passes the planner prices without running them (aot/plan/rebucket.py)
PRICED_ANALYTICALLY = ("bucket_all_reduces", "split_hierarchical")


def run_passes(gm: torch.fx.GraphModule, options: PassOptions = PassOptions(), *, only=None, skip=()) -> torch.fx.GraphModule:
    """`gm` through PASSES in order: those named in `only` (all by default) but for those in `skip`."""
    unknown = {*(only or ()), *skip} - {name for name, _ in PASSES}
    assert not unknown, f"no such pass: {sorted(unknown)}"
    with lint_once():
        for name, run in PASSES:
            if (only is None or name in only) and name not in skip:
                gm = run(gm, options)
    gm.graph.lint()
    return gm


__all__ = [
    "CLEANUP",
    "PASSES",
    "PRICED_ANALYTICALLY",
    "PassOptions",
    "run_passes",
    "bucket_all_reduces",
    "drop_profiler_calls",
    "plain_collectives",
    "issue_early_wait_late",
    "merge_repeated_backward",
    "prefetch_parameter_gathers",
    "regather_in_backward",
    "split_hierarchical",
]
