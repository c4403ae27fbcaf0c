"""A plan (a mesh, a bucket size, a placement and its predicted step) and how plans rank: what the
strategy search (aot/plan/search.py) and its pipeline part (aot/plan/pipeline_search.py) make and
compare."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aot.defaults import DEFAULT_BUCKET_MB
from aot.plan.cost_model import Prediction
from aot.plan.placement import Placement
from runner.format.axes import DATA_AXES, DP, EP, FSDP, TP

MEMORY_HEADROOM = 0.9  # of device memory: the CUDA context, allocator caching and fragmentation take the rest


def strategy_string(axes, shape) -> str:
    return ",".join(f"{a}={d}" for a, d in zip(axes, shape))


def mesh_name(axes, shape) -> str:
    """A mesh as --strategy writes it: the axes with degree > 1 (the first axis if none)."""
    kept = [(a, d) for a, d in zip(axes, shape) if d > 1] or [(axes[0], shape[0])]
    return strategy_string(*zip(*kept))


def mesh_words(source: tuple) -> str:
    """A traced mesh (dp, fsdp, tp[, ep]) in words."""
    return " x ".join(a if a == DP else f"{a}={d}" for a, d in zip((DP, FSDP, TP, EP), source) if d > 1) or "one rank"


@dataclass
class Plan:
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    bucket_mb: float
    placement: Placement
    prediction: Prediction
    fits: bool
    nccl_algo: str | None = None
    notes: list[str] = field(default_factory=list)
    recompute: float | None = None  # the activation budget recomputation was priced at (None: none)
    pipeline: dict | None = None  # pp plans: microbatches, schedule, bubble_s
    # the all_reduce algorithm the split in two levels priced flat all_reduces with (search.py
    # Planner._split_levels), which the build's own choice must use to split the same ones
    split_flat_algorithm: str | None = None

    @property
    def data_ranks(self) -> int:
        """Ranks that take a batch of their own (dp x fsdp x ep): a step trains on that many batches."""
        size = dict(zip(self.axes, self.shape))
        return math.prod(size.get(a, 1) for a in DATA_AXES)

    @property
    def strategy(self) -> str:
        """The --strategy that builds this plan: axes with degree > 1, outermost first (the build
        applies the plan's placement to the mesh written in this order)."""
        size = dict(zip(self.axes, self.shape))
        order = [a for a in self.placement.order if size[a] > 1] or [self.axes[0]]
        return strategy_string(order, [size[a] for a in order])

    def row(self) -> dict:
        p = self.prediction
        return {
            "strategy": self.strategy,
            "bucket_mb": self.bucket_mb,
            "recompute": self.recompute,
            "fits": self.fits,
            "data_ranks": self.data_ranks,
            **p.to_json(),
            "placement": self.placement.to_json(rank_map=False),
            "nccl_algo": self.nccl_algo,
            **({"pipeline": self.pipeline} if self.pipeline else {}),
        }


def per_sample_s(plan: Plan) -> float:
    """Predicted seconds per sample of the batch size: `--batch-size` is per data-parallel rank, so
    a step trains on data_ranks batches (tp ranks and pipeline stages share one)."""
    return plan.prediction.step_s / plan.data_ranks


def rank_key(plan: Plan):
    """Plans that fit first, then by predicted time per sample (the most samples per second), then
    memory, then the fewest collectives."""
    p = plan.prediction
    return (not plan.fits, round(per_sample_s(plan), 15), p.memory.peak, p.collectives, abs(plan.bucket_mb - DEFAULT_BUCKET_MB))
