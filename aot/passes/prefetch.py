"""FSDP parameter prefetch: gather the next layer's parameters while this layer computes.

Each sharded parameter is all-gathered before its first use. Issuing every gather at the start
of the step would hold all full parameters at once; issuing each only when needed would leave the
transfer exposed. As FSDP does, each gather is issued right before the previous parameter's
result is waited for (prefetch depth 1), so one transfer is always in flight under compute. Run
after `issue_early_wait_late`, which puts each wait right before the first use of its result.
"""

from __future__ import annotations

import torch

from aot.passes.graph_utils import ALL_GATHER, is_call


def prefetch_parameter_gathers(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    gathers = [n for n in gm.graph.nodes if is_call(n, {ALL_GATHER}) and n.args[0].op == "placeholder"]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    # In the order their results are needed; each gather has exactly one wait as its user.
    gathers.sort(key=lambda g: position[next(iter(g.users))])
    for previous, gather in zip(gathers, gathers[1:]):
        next(iter(previous.users)).prepend(gather)
    gm.graph.lint()
    gm.recompile()
    return gm
