"""FSDP parameter prefetch: gather the next layers' parameters while this layer computes.

Each sharded parameter is all-gathered before its first use. Issuing every gather at the start
of the step would hold all full parameters at once; issuing each only when needed would leave the
transfer exposed. As FSDP does, each gather is issued while an earlier parameter is still waited
for, so transfers are always in flight under compute. How far ahead is a memory budget: the full
parameters gathered ahead of the one about to be used may take `budget_bytes` in all (at least one
parameter, whatever the budget: FSDP's prefetch depth 1, the default). A larger budget issues
gathers earlier, hiding more of a slow link, for more memory at the peak.

The order is the same on every rank (it depends only on the graph), so no rank can deadlock.
Run after `issue_early_wait_late`, which puts each wait right before the first use of its result.
"""

from __future__ import annotations

import torch

from aot.passes.graph_utils import lint, shard_gathers, tensor_bytes


def prefetch_parameter_gathers(gm: torch.fx.GraphModule, budget_bytes: int | None = None) -> torch.fx.GraphModule:
    casts = shard_gathers(gm.graph)
    gathers = list(casts)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    # In the order their results are needed; each gather has exactly one wait as its user.
    gathers.sort(key=lambda g: position[next(iter(g.users))])
    waits = [next(iter(g.users)) for g in gathers]
    sizes = [tensor_bytes(g) for g in gathers]
    budget = budget_bytes or 0
    for k in range(1, len(gathers)):
        # Issue gather k before the wait of gather j: at that moment gathers j+1..k are held ahead
        # of use. The earliest j whose window fits the budget; never later than j = k - 1.
        j, ahead = k - 1, sizes[k]
        while j > 0 and ahead + sizes[j] <= budget:
            ahead += sizes[j]
            j -= 1
        for node in [*casts[gathers[k]], gathers[k]]:  # a shard's cast to the gather dtype goes with it
            waits[j].prepend(node)  # later gathers land after earlier ones before the same wait
    lint(gm.graph)
    gm.recompile()
    return gm
