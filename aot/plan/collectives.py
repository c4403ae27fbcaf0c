"""Alpha-beta(-gamma) cost of collectives, per algorithm, and the choice of the cheapest.

Symbols (as in /shared/reference/hardware.md, after Thakur, Rabenseifner and Gropp 2005):
p ranks, n bytes (the whole tensor: the all_gather output, the reduce_scatter input, the
all_reduce buffer), alpha seconds per message, beta seconds per byte, gamma seconds per byte
reduced.

| collective, algorithm              | seconds                                                    |
|------------------------------------|------------------------------------------------------------|
| all_gather, ring                   | (p-1)a + ((p-1)/p) n b                                     |
| all_gather, recursive doubling     | ceil(lg p) a + ((p-1)/p) n b                               |
| reduce_scatter, ring               | (p-1)a + ((p-1)/p) n (b+g)                                 |
| reduce_scatter, recursive halving  | ceil(lg p) a + ((p-1)/p) n (b+g)                           |
| all_reduce, ring                   | 2(p-1)a + 2((p-1)/p) n b + ((p-1)/p) n g                   |
| all_reduce, Rabenseifner           | 2 ceil(lg p) a + 2((p-1)/p) n b + ((p-1)/p) n g            |
| all_reduce, double binary tree     | 2 ceil(lg p) a + 2 n b + n g  (pipelined; NCCL's Tree)     |
| all_to_all, pairwise               | (p-1)a + ((p-1)/p) n b  (n: one rank's send buffer)        |
| hierarchical (N nodes x g ranks)   | intra-node reduce-scatter, inter-node collective per rail  |
|                                    | on n/g bytes, intra-node all-gather (see `hierarchical`)   |

The reference's tree row omits gamma; here every algorithm that reduces pays gamma on the bytes
it reduces (n for the tree, whose interior ranks reduce whole pipelined chunks). Recursive
algorithms on a non-power-of-two p are counted with ceil(lg p) steps (MPICH adds one exchange
with the ranks past the largest power of two; that is the ceiling's extra step).

A `Span` says what a group's ranks cross: `p` ranks in all, `nodes` nodes with `per_node` ranks of
the group each, `intra` the alpha-beta-gamma of the slowest link between two of its ranks inside a
node, `inter` that of one network rail and `rails` the rails each node can drive at once. A flat
algorithm over a group that spans nodes runs at its bottleneck: the network's alpha per step and,
per byte, the slower of the intra-node link and the network, whose per-byte cost is
`inter.beta / min(rails, per_node)`: the group's `per_node` ranks on a node drive up to `rails`
rails at once (one ring channel per rail, as NCCL does), so a node's share of the bytes crosses
the network that many times faster. `rails` is the group's share of the node's rails (fractional
when several groups of one mesh axis share them), and the hierarchical algorithm's (g/k) b2 is the
same share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

SEND_RECV = "send_recv"  # point-to-point, a pipeline's stage transfers: alpha + n beta over the pair's link

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

# Algorithms by collective kind, in the order ties are broken.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_gather": ("ring", "recursive_doubling", "hierarchical"),
    "reduce_scatter": ("ring", "recursive_halving", "hierarchical"),
    "all_reduce": ("ring", "rabenseifner", "double_binary_tree", "hierarchical"),
    # expert parallelism's token dispatch: each rank sends a chunk to every other (NCCL and gloo
    # both run p-1 point-to-point exchanges)
    "all_to_all": ("pairwise",),
}

# What each backend can actually run for a collective the graph issues. NCCL picks among Ring and
# Tree per call (pinned with NCCL_ALGO); MPI-style recursive algorithms are not NCCL's. Gloo's
# CPU collectives are ring-based. Hierarchical needs the graph to issue sub-group collectives.
REALIZABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "nccl": {"all_gather": ("ring",), "reduce_scatter": ("ring",), "all_reduce": ("ring", "double_binary_tree"), "all_to_all": ("pairwise",)},
    "gloo": {"all_gather": ("ring",), "reduce_scatter": ("ring",), "all_reduce": ("ring",), "all_to_all": ("pairwise",)},
}

# torch functional-collective op names -> the kinds above
OP_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


@dataclass(frozen=True)
class Link:
    """Cost of one message over one link class: alpha s + bytes * beta s (+ bytes * gamma s reduced)."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def scaled(self, beta_factor: float) -> "Link":
        return replace(self, beta=self.beta * beta_factor)


@dataclass(frozen=True)
class Span:
    """The links a process group crosses (see the module docstring)."""

    p: int
    intra: Link
    nodes: int = 1
    per_node: int | None = None
    inter: Link | None = None
    rails: float = 1.0

    def __post_init__(self) -> None:
        if self.per_node is None:
            object.__setattr__(self, "per_node", self.p // max(self.nodes, 1))
        if self.nodes > 1 and self.inter is None:
            raise ValueError("a span over several nodes needs the inter-node link")

    def flat(self) -> Link:
        """The link a flat (single-level) algorithm sees: its bottleneck."""
        if self.nodes <= 1:
            return self.intra
        # __post_init__ filled per_node and refused several nodes without an inter-node link
        assert self.per_node is not None and self.inter is not None
        beta = max(self.intra.beta if self.per_node > 1 else 0.0, self.inter.beta / min(self.rails, self.per_node))
        return Link(alpha=max(self.intra.alpha, self.inter.alpha), beta=beta, gamma=self.intra.gamma)


def lg(p: int) -> int:
    """ceil(log2 p): the steps of a recursive algorithm over p ranks."""
    return max(0, math.ceil(math.log2(p))) if p > 1 else 0


# -- flat algorithms over one link class ------------------------------------------------------


def all_to_all_pairwise(p: int, n: float, c: Link) -> float:
    # every rank keeps its own chunk and sends each of the other p-1 its (1/p) n bytes
    return (p - 1) * c.alpha + (p - 1) / p * n * c.beta if p > 1 else 0.0


def all_gather_ring(p: int, n: float, c: Link) -> float:
    return (p - 1) * c.alpha + (p - 1) / p * n * c.beta if p > 1 else 0.0


def all_gather_recursive_doubling(p: int, n: float, c: Link) -> float:
    return lg(p) * c.alpha + (p - 1) / p * n * c.beta if p > 1 else 0.0


def reduce_scatter_ring(p: int, n: float, c: Link) -> float:
    return (p - 1) * c.alpha + (p - 1) / p * n * (c.beta + c.gamma) if p > 1 else 0.0


def reduce_scatter_recursive_halving(p: int, n: float, c: Link) -> float:
    return lg(p) * c.alpha + (p - 1) / p * n * (c.beta + c.gamma) if p > 1 else 0.0


def all_reduce_ring(p: int, n: float, c: Link) -> float:
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * c.alpha + 2 * (p - 1) / p * n * c.beta + (p - 1) / p * n * c.gamma


def all_reduce_rabenseifner(p: int, n: float, c: Link) -> float:
    if p <= 1:
        return 0.0
    return 2 * lg(p) * c.alpha + 2 * (p - 1) / p * n * c.beta + (p - 1) / p * n * c.gamma


def all_reduce_double_binary_tree(p: int, n: float, c: Link) -> float:
    return 2 * lg(p) * c.alpha + 2 * n * c.beta + n * c.gamma if p > 1 else 0.0


FLAT = {
    ("all_gather", "ring"): all_gather_ring,
    ("all_gather", "recursive_doubling"): all_gather_recursive_doubling,
    ("reduce_scatter", "ring"): reduce_scatter_ring,
    ("reduce_scatter", "recursive_halving"): reduce_scatter_recursive_halving,
    ("all_reduce", "ring"): all_reduce_ring,
    ("all_reduce", "rabenseifner"): all_reduce_rabenseifner,
    ("all_reduce", "double_binary_tree"): all_reduce_double_binary_tree,
    ("all_to_all", "pairwise"): all_to_all_pairwise,
}


# -- hierarchical -------------------------------------------------------------------------------


def hierarchical(kind: str, span: Span, n: float) -> float:
    """Two levels, g = span.per_node ranks in each of N = span.nodes nodes, k = span.rails rails:

    all_reduce:     intra reduce-scatter (ring, n) + inter all_reduce per rail (ring, n/g)
                    + intra all-gather (ring, n)
                    = 2(g-1)a1 + 2((g-1)/g) n b1 + ((g-1)/g) n g1
                      + 2(N-1)a2 + 2((N-1)/N)(n/g) b2' + ((N-1)/N)(n/g) g1
    reduce_scatter: intra reduce-scatter (n) + inter reduce-scatter per rail (n/g)
    all_gather:     inter all-gather per rail (n/g) + intra all-gather (n)

    with b2' = (g/k) b2 when the node's g ranks share k < g rails (b2 otherwise). On one node it
    is the flat ring; with one rank per node, the flat ring over the network.
    """
    g, N = span.per_node, span.nodes
    assert g is not None  # Span.__post_init__ fills it
    if N <= 1:
        return FLAT[(kind, "ring")](g, n, span.intra)
    assert span.inter is not None  # Span.__post_init__ refuses several nodes without it
    inter = span.inter.scaled(g / span.rails) if span.rails < g else span.inter
    inter = replace(inter, gamma=span.intra.gamma)
    if kind == "all_reduce":
        return reduce_scatter_ring(g, n, span.intra) + all_reduce_ring(N, n / g, inter) + all_gather_ring(g, n, span.intra)
    if kind == "reduce_scatter":
        return reduce_scatter_ring(g, n, span.intra) + reduce_scatter_ring(N, n / g, inter)
    if kind == "all_gather":
        return all_gather_ring(N, n / g, inter) + all_gather_ring(g, n, span.intra)
    raise ValueError(f"unknown collective kind {kind!r}")


def cost(kind: str, algorithm: str, span: Span, n: float) -> float:
    """Seconds for one `kind` collective of `n` bytes over `span` with `algorithm`."""
    if kind not in ALGORITHMS:
        raise ValueError(f"unknown collective kind {kind!r} (known: {', '.join(KINDS)})")
    if algorithm not in ALGORITHMS[kind]:
        raise ValueError(f"{kind} has no algorithm {algorithm!r} (known: {', '.join(ALGORITHMS[kind])})")
    if span.p <= 1:
        return 0.0
    if algorithm == "hierarchical":
        return hierarchical(kind, span, n)
    return FLAT[(kind, algorithm)](span.p, n, span.flat())


def best(kind: str, span: Span, n: float, algorithms: tuple[str, ...] | None = None) -> tuple[str, float]:
    """(algorithm, seconds) of the cheapest algorithm for this size and placement. `algorithms`
    limits the choice (e.g. REALIZABLE[backend][kind]); ties go to the earlier one."""
    options = algorithms or ALGORITHMS[kind]
    if span.p <= 1:
        return options[0], 0.0
    priced = [(cost(kind, a, span, n), i, a) for i, a in enumerate(options)]
    seconds, _, algorithm = min(priced)
    return algorithm, seconds


def bus_bytes(kind: str, p: int, n: float) -> float:
    """Bytes each rank sends for a ring `kind` over p ranks (nccl-tests' bus-bandwidth factor x n)."""
    if p <= 1:
        return 0.0
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    return factor * n
