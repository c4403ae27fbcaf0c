"""The alpha-beta(-gamma) formulas of aot.plan.collectives against values worked out by hand."""

from __future__ import annotations

import pytest

from aot.plan import collectives as C
from aot.plan.collectives import Link, Span

# alpha 10 us, beta 1 ns/B (1 GB/s), gamma 0.1 ns/B; 4 ranks; 1 MB
L = Link(alpha=1e-5, beta=1e-9, gamma=1e-10)
P, N = 4, 1e6


@pytest.mark.parametrize(
    "kind,algorithm,expected",
    [
        # (p-1)a + ((p-1)/p) n b = 3e-5 + 0.75e-3
        ("all_gather", "ring", 7.8e-4),
        # lg4 = 2: 2e-5 + 0.75e-3
        ("all_gather", "recursive_doubling", 7.7e-4),
        # 3e-5 + 0.75 * 1e6 * 1.1e-9 = 3e-5 + 8.25e-4
        ("reduce_scatter", "ring", 8.55e-4),
        ("reduce_scatter", "recursive_halving", 8.45e-4),
        # 2*3*1e-5 + 2*0.75*1e-3 + 0.75*1e6*1e-10 = 6e-5 + 1.5e-3 + 7.5e-5
        ("all_reduce", "ring", 1.635e-3),
        # 2*2*1e-5 + 1.5e-3 + 7.5e-5
        ("all_reduce", "rabenseifner", 1.615e-3),
        # 2*2*1e-5 + 2*1e6*1e-9 + 1e6*1e-10 = 4e-5 + 2e-3 + 1e-4
        ("all_reduce", "double_binary_tree", 2.14e-3),
    ],
)
def test_flat_formulas_on_one_link(kind, algorithm, expected):
    assert C.cost(kind, algorithm, Span(p=P, intra=L), N) == pytest.approx(expected, rel=1e-12)


def test_non_power_of_two_counts_the_ceiling_of_lg_p():
    # p = 5: ceil(lg 5) = 3 steps; (p-1)/p = 0.8
    assert C.lg(5) == 3 and C.lg(8) == 3 and C.lg(1) == 0 and C.lg(2) == 1
    assert C.all_gather_recursive_doubling(5, N, L) == pytest.approx(3e-5 + 0.8e-3, rel=1e-12)
    assert C.all_reduce_rabenseifner(5, N, L) == pytest.approx(6e-5 + 1.6e-3 + 8e-5, rel=1e-12)


def test_one_rank_costs_nothing():
    for kind, algorithms in C.ALGORITHMS.items():
        for algorithm in algorithms:
            assert C.cost(kind, algorithm, Span(p=1, intra=L), N) == 0.0


# Two nodes of four ranks: NVLink-like inside (1 us, 100 GB/s), one network rail per rank (10 us, 25 GB/s).
INTRA = Link(alpha=1e-6, beta=1e-11)
INTER = Link(alpha=1e-5, beta=4e-11)
TWO_NODES = Span(p=8, intra=INTRA, nodes=2, per_node=4, inter=INTER, rails=4)


def test_hierarchical_all_reduce_matches_the_reference_formula():
    n = 8e6
    # 2(g-1)a1 + 2((g-1)/g) n b1 + 2(N-1)a2 + 2((N-1)/N)(n/g) b2
    # = 6e-6 + 1.2e-4 + 2e-5 + 8e-5
    assert C.cost("all_reduce", "hierarchical", TWO_NODES, n) == pytest.approx(2.26e-4, rel=1e-12)
    # 4 ranks sharing 2 rails: b2' = (g/k) b2 = 8e-11, the inter-node term doubles its bandwidth part
    shared = Span(p=8, intra=INTRA, nodes=2, per_node=4, inter=INTER, rails=2)
    assert C.cost("all_reduce", "hierarchical", shared, n) == pytest.approx(2.26e-4 + 8e-5, rel=1e-12)


def test_hierarchical_all_gather_and_reduce_scatter():
    n = 8e6
    # inter all_gather of n/g per rail: (N-1)a2 + ((N-1)/N)(n/g) b2 = 1e-5 + 4e-5; intra: 3e-6 + 6e-5
    assert C.cost("all_gather", "hierarchical", TWO_NODES, n) == pytest.approx(1.13e-4, rel=1e-12)
    assert C.cost("reduce_scatter", "hierarchical", TWO_NODES, n) == pytest.approx(1.13e-4, rel=1e-12)


def test_flat_algorithms_over_nodes_run_at_the_bottleneck():
    flat = TWO_NODES.flat()
    # network alpha per step; per byte the slower of NVLink (1e-11) and 4 rails (4e-11 / 4)
    assert flat.alpha == 1e-5 and flat.beta == pytest.approx(1e-11)
    # ring over 8 ranks: 14 a + 2 (7/8) n b
    assert C.cost("all_reduce", "ring", TWO_NODES, 8e6) == pytest.approx(1.4e-4 + 1.4e-4, rel=1e-12)
    # one rank of the group per node, 8 groups sharing 8 rails: one rail each
    across = Span(p=2, intra=INTRA, nodes=2, per_node=1, inter=INTER, rails=1)
    assert across.flat().beta == pytest.approx(4e-11)
    # four groups sharing two rails: half a rail each
    half = Span(p=2, intra=INTRA, nodes=2, per_node=1, inter=INTER, rails=0.5)
    assert half.flat().beta == pytest.approx(8e-11)


def test_the_cheapest_algorithm_depends_on_size_and_what_the_backend_runs():
    # 1 KB: latency rules; hierarchical pays 2 network steps, the flat ones 2 lg 8 = 6 or 14
    assert C.best("all_reduce", TWO_NODES, 1e3)[0] == "hierarchical"
    # 800 MB: bandwidth rules; Rabenseifner moves the ring's bytes in fewer steps
    algorithm, seconds = C.best("all_reduce", TWO_NODES, 8e8)
    assert algorithm == "rabenseifner" and seconds == pytest.approx(6e-5 + 1.4e-2, rel=1e-12)
    # what NCCL can run: tree for small messages, ring for large ones
    nccl = C.REALIZABLE["nccl"]["all_reduce"]
    assert C.best("all_reduce", TWO_NODES, 1e3, nccl)[0] == "double_binary_tree"
    assert C.best("all_reduce", TWO_NODES, 8e8, nccl)[0] == "ring"
    assert C.best("all_reduce", Span(p=1, intra=L), 1e6) == ("ring", 0.0)


def test_bus_bytes_are_the_nccl_tests_factors():
    assert C.bus_bytes("all_reduce", 4, 1e6) == pytest.approx(1.5e6)
    assert C.bus_bytes("all_gather", 4, 1e6) == pytest.approx(0.75e6)
    assert C.bus_bytes("reduce_scatter", 1, 1e6) == 0.0


def test_all_to_all_sends_every_other_rank_its_chunk():
    """Expert parallelism's dispatch: p-1 messages, (p-1)/p of the send buffer over the link."""
    n = 8e6
    assert C.cost("all_to_all", "pairwise", Span(p=4, intra=L), n) == pytest.approx(3 * L.alpha + 0.75 * n * L.beta)
    assert C.cost("all_to_all", "pairwise", Span(p=1, intra=L), n) == 0.0
    assert C.bus_bytes("all_to_all", 4, n) == pytest.approx(0.75 * n)


def test_unknown_kinds_and_algorithms_are_refused():
    with pytest.raises(ValueError, match="unknown collective"):
        C.cost("gather", "ring", Span(p=2, intra=L), 1.0)
    with pytest.raises(ValueError, match="no algorithm"):
        C.cost("all_to_all", "ring", Span(p=2, intra=L), 1.0)
    with pytest.raises(ValueError, match="no algorithm"):
        C.cost("all_gather", "rabenseifner", Span(p=2, intra=L), 1.0)
