"""What the planner's tests share."""

from __future__ import annotations


class NothingFits:
    """A memory limit (aot.plan.search.MemoryLimit's questions) under which every graph gets its
    recomputing variants: the first budget's and the least one's."""

    def over(self, graph):
        return True

    def beyond_recompute(self, graph):
        return False

    bytes = 0.0  # no budget above the first is worth a variant (aot.plan.variant_budgets.roomier_target)

    def default_peak(self, graph):
        return graph.memory.peak

    def more_may_help(self, graph, sharded):
        return True
