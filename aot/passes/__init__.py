"""Graph passes: each a function from an FX graph module to an FX graph module, with its own test.

The build runs them in `pipeline` order; each is free of the others' details, so they compose.
"""

from __future__ import annotations

import torch

from aot.passes.bucketing import bucket_all_reduces
from aot.passes.cleanup import drop_profiler_calls, plain_collectives
from aot.passes.hierarchical import split_hierarchical
from aot.passes.overlap import issue_early_wait_late
from aot.passes.prefetch import prefetch_parameter_gathers
from aot.passes.regather import regather_in_backward
from aot.passes.repeated_backward import merge_repeated_backward


def run_passes(gm: torch.fx.GraphModule, *, bucket_bytes: int, prefetch_bytes: int | None = None, hierarchical=None) -> torch.fx.GraphModule:
    """`hierarchical(group, bytes)`: the sub-groups to split that all_reduce over, or None
    (aot.plan.hierarchy.chooser)."""
    gm = drop_profiler_calls(gm)
    gm = merge_repeated_backward(gm)
    gm = plain_collectives(gm)
    gm = bucket_all_reduces(gm, bucket_bytes)
    gm = split_hierarchical(gm, hierarchical)
    gm = issue_early_wait_late(gm)
    gm = regather_in_backward(gm)
    gm = prefetch_parameter_gathers(gm, prefetch_bytes)
    return gm


__all__ = [
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
