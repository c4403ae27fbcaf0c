"""Links, islands and mesh placement on the built-in topology profiles."""

from __future__ import annotations

import copy

import pytest

from aot.plan.collectives import Link
from aot.plan.machine import Machine
from aot.plan.mesh import Mesh
from aot.plan.placement import layout, place
from runner.hardware.topology import for_nodes, load_profile

TP_HEAVY = {"tp": 1e9, "dp": 1e6}  # bytes per step per rank over each axis


def test_links_of_the_pcie_box_come_from_its_profile():
    m = Machine(load_profile("pcie_4gpu_nvlink_pairs"))
    cls, link = m.pair(0, 1)
    # NVLink bridge: 300 GB/s per direction, counted at NCCL's 80%
    assert cls == "nvlink" and link.beta == pytest.approx(1 / (300e9 * 0.8)) and link.alpha == 2e-6
    cls, link = m.pair(0, 2)
    # across the sockets: PCIe Gen5 x16 (3.938 GB/s per lane) at NCCL's 76%, halved without P2P
    assert cls == "pcie" and link.beta == pytest.approx(1 / (3.938 * 16 * 1e9 * 0.76 * 0.5))
    assert m.device_order() == [0, 1, 2, 3]


def test_cpu_ranks_talk_over_loopback_and_calibration_overrides_defaults():
    profile = load_profile("cpu")
    m = Machine(profile, 2)
    assert m.pair(0, 1)[0] == "loopback" and m.per_node == 2 and m.memory_bytes is None
    calibrated = {
        **profile,
        "calibration": {
            "loopback": {
                "alpha_s": 1e-4,
                "beta_s_per_byte": 2e-9,
                "gamma_s_per_byte": 0.0,
                "per_kind": {"all_gather": {"alpha_s": 3e-4, "beta_s_per_byte": 4e-9, "gamma_s_per_byte": 0.0}},
            }
        },
    }
    m = Machine(calibrated, 2)
    assert m.span([0, 1], "all_reduce").intra == Link(1e-4, 2e-9, 0.0)
    assert m.span([0, 1], "all_gather").intra == Link(3e-4, 4e-9, 0.0)


def test_a_span_across_nodes_shares_the_rails_among_the_groups_of_an_axis():
    m = Machine(for_nodes(load_profile("dgx_a100"), 2), 16)
    whole = m.span(list(range(16)))
    assert (whole.p, whole.nodes, whole.per_node, whole.rails) == (16, 2, 8, 8)
    # HDR: 25 GB/s per rail
    assert whole.inter.beta == pytest.approx(1 / 25e9)
    pair = m.span([3, 11])  # one rank per node: one of the 8 groups, one rail's worth each
    assert (pair.p, pair.nodes, pair.per_node, pair.rails) == (2, 2, 1, 1)


def test_tp_lands_on_the_nvlink_pairs_of_the_pcie_box():
    m = Machine(load_profile("pcie_4gpu_nvlink_pairs"))
    p = place(m, ("dp", "tp"), (2, 2), TP_HEAVY)
    assert p.groups("tp") == [[0, 1], [2, 3]] and p.groups("dp") == [[0, 2], [1, 3]]
    assert p.identity and p.order == ("dp", "tp")
    # the mesh written the other way round still puts tp on the pairs
    q = place(m, ("tp", "dp"), (2, 2), TP_HEAVY)
    assert q.groups("tp") == [[0, 1], [2, 3]] and q.order == ("dp", "tp") and not q.identity
    assert q.coords(1) == {"tp": 1, "dp": 0} and q.coords(2) == {"tp": 0, "dp": 1}


def test_islands_follow_the_links_not_the_numbering():
    profile = copy.deepcopy(load_profile("pcie_4gpu_nvlink_pairs"))
    buses = sorted(profile["node"]["gpus"], key=lambda b: profile["node"]["gpus"][b]["index"])
    # rewire: NVLink bridges join GPU0-GPU2 and GPU1-GPU3 instead
    for link in profile["node"]["links"]:
        pair = {profile["node"]["gpus"][b]["index"] for b in link["gpus"]}
        link["nvlink"] = {"count": 12, "gb_per_s_per_direction": 300.0, "via": "direct"} if pair in ({0, 2}, {1, 3}) else None
    m = Machine(profile)
    assert m.device_order() == [0, 2, 1, 3]
    p = place(m, ("dp", "tp"), (2, 2), TP_HEAVY)
    assert p.groups("tp") == [[0, 2], [1, 3]]
    assert buses  # the profile still names four GPUs


def test_tp8_stays_inside_a_node_of_two_dgx_a100():
    m = Machine(for_nodes(load_profile("dgx_a100"), 2), 16)
    for axes, shape in ((("dp", "tp"), (2, 8)), (("tp", "dp"), (8, 2))):
        p = place(m, axes, shape, TP_HEAVY)
        assert p.groups("tp") == [list(range(8)), list(range(8, 16))]
        assert sorted(p.groups("dp")) == [[i, i + 8] for i in range(8)]
    # were dp the heavy axis, it would take the node instead
    p = place(m, ("dp", "tp"), (2, 8), {"tp": 1e6, "dp": 1e9})
    assert p.groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]


def test_default_traffic_puts_tp_innermost_and_fsdp_inside_dp():
    m = Machine(for_nodes(load_profile("dgx_h100"), 4), 32)
    p = place(m, ("dp", "fsdp", "tp"), (2, 2, 8))
    assert p.order[-1] == "tp" and p.order.index("fsdp") > p.order.index("dp")
    assert p.groups("tp")[0] == list(range(8))


def test_identity_layout_agrees_with_the_mesh():
    m = Machine(for_nodes(load_profile("dgx_a100"), 1), 8)
    mesh = Mesh(("dp", "fsdp"), (2, 4))
    p = layout(m, mesh.axes, mesh.shape, mesh.axes, list(range(8)))
    assert p.identity
    for axis in mesh.axes:
        assert p.groups(axis) == mesh.groups(axis)
    assert all(p.coords(r) == mesh.coords(r) for r in range(8))


def _rewired(pairs: tuple[set[int], ...]) -> dict:
    """The PCIe box with its NVLink bridges between the given GPU index pairs instead."""
    profile = copy.deepcopy(load_profile("pcie_4gpu_nvlink_pairs"))
    for link in profile["node"]["links"]:
        pair = {profile["node"]["gpus"][b]["index"] for b in link["gpus"]}
        link["nvlink"] = {"count": 12, "gb_per_s_per_direction": 300.0, "via": "direct"} if pair in pairs else None
    return profile


def test_every_group_lists_its_ranks_ascending_in_coordinate_order():
    """torch's new_group sorts its ranks, so a rank's place in a collective is its place in the
    sorted group: place() returns only placements where that place is the rank's coordinate."""
    # bridges 0-3 and 1-2: tp on them would put some dp group's ranks against their coordinates
    m = Machine(_rewired(({0, 3}, {1, 2})))
    assert m.device_order() == [0, 3, 1, 2]
    assert not layout(m, ("dp", "tp"), (2, 2), ("dp", "tp")).ascending
    p = place(m, ("dp", "tp"), (2, 2), TP_HEAVY)
    assert p.ascending and p.identity
    # a single axis over an island order that is not the numbering: the identity too
    assert place(Machine(_rewired(({0, 2}, {1, 3}))), ("dp",), (4,)).identity
    for name, nodes, world in (("pcie_4gpu_nvlink_pairs", 1, 4), ("dgx_a100", 2, 16), ("dgx_h100", 2, 16), ("cpu", 2, 8)):
        m = Machine(for_nodes(load_profile(name), nodes), world)
        for axes, shape in (
            (("dp", "tp"), (world // 2, 2)),
            (("tp", "dp"), (2, world // 2)),
            (("dp", "fsdp", "tp"), (world // 4, 2, 2)),
            (("tp", "fsdp", "dp"), (2, 2, world // 4)),
        ):
            p = place(m, axes, shape, TP_HEAVY)
            assert p.ascending, (name, axes, shape, p.physical)
            for axis in axes:
                assert all(group == sorted(group) for group in p.groups(axis))


def test_a_plan_placement_carries_over_to_the_mesh_as_built():
    """The planner places (dp, fsdp, tp) meshes; the build writes the strategy without its axes of
    degree 1, outermost first: every physical rank keeps its coordinates."""
    m = Machine(_rewired(({0, 2}, {1, 3})))
    p = place(m, ("dp", "fsdp", "tp"), (2, 1, 2), TP_HEAVY)
    for axes, shape in ((("dp", "tp"), (2, 2)), (("tp", "dp"), (2, 2)), (("dp", "fsdp", "tp"), (2, 1, 2))):
        q = p.reordered(axes, shape)
        assert q.ascending and sorted(q.physical) == [0, 1, 2, 3]
        assert q.groups("tp") == [[0, 2], [1, 3]] and q.order[-1] == "tp"
        for r in range(4):
            assert q.coords(r) == {a: p.coords(r)[a] for a in axes}
    assert p.reordered(("dp", "tp"), (2, 2)).physical == (0, 2, 1, 3)
    with pytest.raises(ValueError):
        p.reordered(("dp",), (4,))


def test_the_build_places_the_mesh_identity_where_islands_follow_the_numbering():
    from aot.build import place_mesh

    cases = [
        ("cpu", "dp=2,tp=2", True),
        ("pcie_4gpu_nvlink_pairs", "dp=2,tp=2", True),
        ("pcie_4gpu_nvlink_pairs", "fsdp=2,tp=2", True),
        ("dgx_a100", "dp=2,fsdp=2", True),
    ]
    for name, strategy, identity in cases:
        mesh = Mesh.parse(strategy, 4)
        assert place_mesh(mesh, for_nodes(load_profile(name), None, 4)).identity is identity, name
    crossed = place_mesh(Mesh.parse("dp=2,tp=2", 4), _rewired(({0, 2}, {1, 3})))
    assert crossed.physical == (0, 2, 1, 3) and crossed.groups("tp") == [[0, 2], [1, 3]]
    # two DGX A100 with tp written outermost: tp still fills each node, dp crosses them
    two = place_mesh(Mesh.parse("tp=8,dp=2", 16), for_nodes(load_profile("dgx_a100"), 2, 16))
    assert two.groups("tp") == [list(range(8)), list(range(8, 16))] and not two.identity and two.ascending
