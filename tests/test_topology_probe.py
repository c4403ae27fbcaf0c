"""The NVML probe and the live check, on a fake NVML fed from fixtures of three machines.

tests/fixtures/topology/ holds what NVML and sysfs report on a DGX A100, an 8-GPU PCIe box and a
4-GPU box with NVLink bridges between pairs (generate.py writes them). fake_nvml.FakeNvml serves
a fixture through pynvml's functions and make_root() writes the matching /sys and /proc; the
probe takes both as parameters. Every mismatch class is produced by changing one fact of a
fixture, the way the hardware would differ.
"""

from __future__ import annotations

import inspect

import pynvml
import pytest

from fixtures.topology.fake_nvml import FakeNvml, fixture, make_root
from runner.errors import AotError
from runner.hardware.nvml_probe import live_profile, path_class, probe
from runner.hardware.topology import load_profile, pair_links, validate_profile
from runner.hardware.topology_check import TopologyMismatch, mismatches, verify_live

IDENTITY = ("uuid", "pci_bus_id", "port")  # facts of one machine, not of the model: not in built-ins


def probed(data: dict | None, tmp_path, env: dict | None = None, **kw) -> dict:
    root = make_root(data, tmp_path / "root") if data else tmp_path
    return probe(nvml=FakeNvml(data), env=env or {}, root=root, name="probed", **kw)


def live(data: dict | None, tmp_path, env: dict | None = None) -> dict:
    root = make_root(data, tmp_path / "root") if data else tmp_path
    return live_profile(nvml=FakeNvml(data), env=env or {}, root=root)


def strip(value):
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in IDENTITY}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def covered(builtin, probed_value, where="") -> list[str]:
    """Where the probe disagrees with a fact the built-in states (null in a built-in: not stated)."""
    if isinstance(builtin, dict):
        return [d for k, v in builtin.items() for d in covered(v, (probed_value or {}).get(k), f"{where}.{k}")]
    if isinstance(builtin, list) and isinstance(probed_value, list) and len(builtin) == len(probed_value):
        return [d for i, (a, b) in enumerate(zip(builtin, probed_value)) for d in covered(a, b, f"{where}[{i}]")]
    return [] if builtin is None or builtin == probed_value else [f"{where}: built-in {builtin!r}, probed {probed_value!r}"]


# -- the fake is pynvml's API ------------------------------------------------------------------


def test_fake_nvml_has_pynvml_names_values_and_signatures():
    fake = FakeNvml(fixture("dgx_a100"))
    for name in dir(FakeNvml):
        if not (name.startswith("nvml") or name.startswith("NVML")):
            continue
        assert hasattr(pynvml, name), f"pynvml has no {name}"
        real, ours = getattr(pynvml, name), getattr(fake, name)
        if name.startswith("NVML") and not inspect.isclass(real):
            assert real == ours, f"{name}: pynvml {real!r}, fake {ours!r}"
        elif callable(real) and not inspect.isclass(real):
            want = [p for p in inspect.signature(real).parameters.values()]
            got = [p for p in inspect.signature(ours).parameters.values()]
            assert [p.default is inspect.Parameter.empty for p in want] == [p.default is inspect.Parameter.empty for p in got], f"{name}: {want} vs {got}"


# -- probe -> profile round trips ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["dgx_a100", "pcie_4gpu_nvlink_pairs"])
def test_probe_of_a_machine_matches_its_builtin(tmp_path, name):
    data = fixture(name)
    profile = probed(data, tmp_path)
    builtin = load_profile(name)
    assert mismatches(builtin, profile) == []
    assert covered(strip(builtin["node"]), strip(profile["node"])) == []
    assert profile["fabric"] == builtin["fabric"]
    assert profile["probe"]["source"] == "nvml" and profile["probe"]["driver_version"] == data["driver_version"]
    # the probe read maxima: every fixture GPU idles at Gen1, the profile says the slot's generation
    assert {g["pcie"]["generation"] for g in profile["node"]["gpus"].values()} == {data["gpus"][0]["pcie_max"][0]}
    # and its own output is a profile: validate, write, read back
    validate_profile(profile, "probe")
    assert mismatches(profile, profile) == []


def test_dgx_a100_probe_facts(tmp_path):
    p = probed(fixture("dgx_a100"), tmp_path)
    gpus = p["node"]["gpus"]
    assert list(gpus) == [f"00000000:{b}:00.0" for b in ("07", "0F", "47", "4E", "87", "90", "B7", "BD")]
    assert [g["numa_node"] for g in gpus.values()] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert gpus["00000000:07:00.0"]["cpu_affinity"] == "48-63,176-191"
    links = pair_links(p)
    assert len(links) == 28
    assert all(l["nvlink"] == {"count": 12, "gb_per_s_per_direction": 300.0, "via": "nvswitch"} for l in links.values())
    assert links[(0, 1)]["pcie_path"] == "PXB" and links[(0, 2)]["pcie_path"] == "SYS"
    assert p["node"]["nvswitches"] == 6
    nics = p["node"]["nics"]
    assert [n["name"] for n in nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    assert all(n["path_to_nearest"] == "PXB" and len(n["nearest_gpus"]) == 2 for n in nics)
    assert p["node"]["cpu"]["numa_nodes"]["3"] == "48-63,176-191"


def test_pcie_8gpu_probe_facts(tmp_path):
    p = probed(fixture("pcie_8gpu"), tmp_path)
    links = pair_links(p)
    assert not any(l["nvlink"] for l in links.values())
    assert (links[(0, 1)]["pcie_path"], links[(0, 2)]["pcie_path"], links[(0, 4)]["pcie_path"]) == ("PIX", "PHB", "SYS")
    assert links[(0, 3)]["p2p"] is True and links[(3, 4)]["p2p"] is False
    assert p["node"]["nvswitches"] == 0
    g0 = p["node"]["gpus"]["00000000:18:00.0"]
    assert g0["peak_tflops"] == {} and g0["memory_bandwidth_gb_per_s"] == pytest.approx(864.1)  # from bus width x clock
    nics = p["node"]["nics"]
    assert [len(n["nearest_gpus"]) for n in nics] == [4, 4] and nics[0]["path_to_nearest"] == "PHB"
    assert p["fabric"]["kind"] == "roce" and p["fabric"]["rails_per_node"] == 2
    assert mismatches(p, probed(fixture("pcie_8gpu"), tmp_path / "again")) == []


def test_path_classes_from_the_pci_tree():
    rp, up = "0000:00:01.0", "0000:01:00.0"
    a = ["pci0000:00", rp, up, "0000:02:00.0", "0000:05:00.0"]
    assert path_class(a, ["pci0000:00", rp, up, "0000:02:01.0", "0000:06:00.0"], 0, 0) == "PIX"
    assert path_class(a, ["pci0000:00", rp, up, "0000:02:01.0", "0000:07:00.0", "0000:08:00.0", "0000:09:00.0"], 0, 0) == "PXB"
    assert path_class(a, ["pci0000:00", "0000:00:02.0", "0000:0a:00.0"], 0, 0) == "PHB"
    assert path_class(a, ["pci0000:40", "0000:40:01.0", "0000:41:00.0"], 0, 0) == "NODE"
    assert path_class(a, ["pci0000:80", "0000:80:01.0", "0000:81:00.0"], 0, 1) == "SYS"
    assert path_class(None, a, 0, 1) == "SYS" and path_class(None, a, None, 1) is None


# -- no GPU, no NVML ---------------------------------------------------------------------------


@pytest.mark.parametrize("nvml", [FakeNvml(None, init_error=12), FakeNvml(None, init_error=9), FakeNvml(None)], ids=["no-library", "no-driver", "no-gpu"])
def test_without_gpus_or_nvml_the_profile_is_this_machines_cpu(tmp_path, nvml):
    p = probe(nvml=nvml, env={}, root=make_root(fixture("dgx_a100") | {"gpus": [], "nics": []}, tmp_path), name="box")
    assert p["device_kind"] == "cpu" and p["backend"] == "gloo" and p["node"]["gpus"] == {}
    assert p["node"]["cpu"]["logical_cpus"] == 256 and p["node"]["cpu"]["sockets"] == 2
    assert len(p["node"]["cpu"]["numa_nodes"]) == 8
    if nvml.init_error:
        assert "NVML unavailable" in p["probe"]["notes"][0]
    live = live_profile(nvml=nvml, env={"GROUP_WORLD_SIZE": "3"}, root=tmp_path)
    assert live["name"] == "cpu" and live["nodes"] == 3


def test_probe_shuts_nvml_down_even_when_it_refuses(tmp_path):
    nvml = FakeNvml(fixture("pcie_8gpu"))
    with pytest.raises(AotError):
        probe(nvml=nvml, env={"CUDA_VISIBLE_DEVICES": "12"}, root=tmp_path)
    assert nvml.refcount == 0
    probe(nvml=nvml, env={}, root=tmp_path)
    assert nvml.refcount == 0


# -- CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER ----------------------------------------------------


def buses(profile) -> list[str]:
    return [bus[9:11] for bus, _ in sorted(profile["node"]["gpus"].items(), key=lambda kv: kv[1]["index"])]


@pytest.mark.parametrize(
    "cvd, want",
    [
        ("0,1,2,3,4,5,6,7", ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]),
        ("2,0", ["3A", "18"]),
        ("7,6,5", ["DB", "BA", "AB"]),
        (" 4 , 1 ", ["9A", "2A"]),
        ("0,-1,3", ["18"]),  # CUDA stops at a negative index
    ],
)
def test_visible_devices_by_index(tmp_path, cvd, want):
    assert buses(probed(fixture("pcie_8gpu"), tmp_path, {"CUDA_VISIBLE_DEVICES": cvd})) == want


def test_reordering_maps_links_numa_and_nics_to_the_physical_gpus(tmp_path):
    p = probed(fixture("pcie_8gpu"), tmp_path, {"CUDA_VISIBLE_DEVICES": "5,0,1"})
    links = pair_links(p)
    # CUDA 0 = physical 5 (socket 1), CUDA 1, 2 = physical 0, 1 (a PIX pair on socket 0)
    assert (links[(0, 1)]["pcie_path"], links[(1, 2)]["pcie_path"]) == ("SYS", "PIX")
    assert (links[(0, 1)]["p2p"], links[(1, 2)]["p2p"]) == (False, True)
    assert [g["numa_node"] for g in sorted(p["node"]["gpus"].values(), key=lambda g: g["index"])] == [1, 0, 0]
    near = {n["name"]: n["nearest_gpus"] for n in p["node"]["nics"]}
    assert near == {"mlx5_0": ["00000000:18:00.0", "00000000:2A:00.0"], "mlx5_1": ["00000000:AB:00.0"]}


def test_visible_devices_by_uuid_and_prefix(tmp_path):
    data = fixture("dgx_a100")
    uuids = [g["uuid"] for g in data["gpus"]]
    p = probed(data, tmp_path, {"CUDA_VISIBLE_DEVICES": f"{uuids[6]},{uuids[1]}"})
    assert buses(p) == ["B7", "0F"]
    assert [g["uuid"] for g in sorted(p["node"]["gpus"].values(), key=lambda g: g["index"])] == [uuids[6], uuids[1]]
    assert buses(probed(data, tmp_path / "b", {"CUDA_VISIBLE_DEVICES": uuids[3][:12]})) == ["4E"]
    # NVLink through the switches is still NV12 between the two visible GPUs
    assert pair_links(p)[(0, 1)]["nvlink"]["count"] == 12


@pytest.mark.parametrize("cvd", ["", "-1"])
def test_no_visible_gpu_is_a_cpu_profile(tmp_path, cvd):
    p = probed(fixture("dgx_a100"), tmp_path, {"CUDA_VISIBLE_DEVICES": cvd})
    assert p["device_kind"] == "cpu" and p["probe"]["cuda_visible_devices"] == cvd


def test_device_order_fastest_first_vs_pci_bus_id(tmp_path):
    data = fixture("pcie_8gpu")
    data["gpus"][5].update(name="NVIDIA H100 PCIe", cc=[9, 0])  # one faster GPU in the box
    assert buses(probed(data, tmp_path))[:2] == ["AB", "18"]  # CUDA's default: FASTEST_FIRST
    assert buses(probed(data, tmp_path / "b", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}))[:2] == ["18", "2A"]
    assert buses(probed(data, tmp_path / "c", {"CUDA_VISIBLE_DEVICES": "0"})) == ["AB"]
    assert buses(probed(data, tmp_path / "d", {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})) == ["18"]


@pytest.mark.parametrize(
    "env, needles",
    [
        ({"CUDA_VISIBLE_DEVICES": "8"}, ["entry '8' names no GPU", "8 GPUs", "indices 0-7"]),
        ({"CUDA_VISIBLE_DEVICES": "0,GPU-00000000-dead"}, ["'GPU-00000000-dead' names no GPU"]),
        ({"CUDA_VISIBLE_DEVICES": "1,1"}, ["'1' names GPU 00000000:2A:00.0 a second time"]),
        ({"CUDA_VISIBLE_DEVICES": "gpu0"}, ["'gpu0' names no GPU", "GPU-<uuid>"]),
        ({"CUDA_VISIBLE_DEVICES": "MIG-1234"}, ["MIG instance"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-"}, ["'GPU-' names no GPU"]),
        ({"CUDA_DEVICE_ORDER": "SLOWEST_FIRST"}, ["CUDA_DEVICE_ORDER='SLOWEST_FIRST'", "PCI_BUS_ID"]),
    ],
    ids=["index-out-of-range", "unknown-uuid", "duplicate", "garbage", "mig", "empty-uuid", "bad-order"],
)
def test_visible_devices_naming_no_gpu_is_one_line(tmp_path, env, needles):
    with pytest.raises(AotError) as e:
        probed(fixture("pcie_8gpu"), tmp_path, env)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_ambiguous_uuid_prefix(tmp_path):
    data = fixture("pcie_4gpu_nvlink_pairs")
    data["gpus"][0]["uuid"] = "GPU-abc1-0000"
    data["gpus"][2]["uuid"] = "GPU-abc2-0000"
    with pytest.raises(AotError, match="matches 2 GPUs"):
        probed(data, tmp_path, {"CUDA_VISIBLE_DEVICES": "GPU-abc"})


# -- every mismatch class, each naming the GPUs involved ---------------------------------------------


def differ(name: str, change, tmp_path, env=None, against=None) -> list[str]:
    """Mismatch lines of `name`'s built-in (or `against`) vs the fixture after `change(data)`."""
    data = fixture(name)
    change(data)
    profile = against or load_profile(name)
    return mismatches(profile, live(data, tmp_path, env))


def one(lines: list[str], prefix: str) -> str:
    hits = [l for l in lines if l.startswith(prefix)]
    assert len(hits) == 1 and len(lines) == 1, lines
    return hits[0]


def test_matching_machine_has_no_mismatch(tmp_path):
    assert differ("dgx_a100", lambda d: None, tmp_path) == []


def test_node_count(tmp_path):
    line = one(differ("dgx_a100", lambda d: None, tmp_path, env={"GROUP_WORLD_SIZE": "2"}), "node count")
    assert "'dgx_a100' is for 1 node" in line and "runs on 2" in line
    lines = differ("dgx_a100", lambda d: None, tmp_path / "b", env={"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert one(lines, "node count")
    assert one(differ("dgx_a100", lambda d: None, tmp_path / "c", env={"WORLD_SIZE": "16", "SLURM_NNODES": "2"}), "node count")
    # a launcher that does not say how many nodes: not guessed, not checked
    assert differ("dgx_a100", lambda d: None, tmp_path / "d", env={"WORLD_SIZE": "16", "RANK": "3"}) == []


def test_gpu_count(tmp_path):
    line = one(
        differ("dgx_a100", lambda d: None, tmp_path, env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, against=probed(fixture("dgx_a100"), tmp_path / "full")),
        "GPU count",
    )
    assert "expects 8 GPUs" in line and "4 visible" in line and "CUDA_VISIBLE_DEVICES=0,1,2,3" in line


def test_gpu_model(tmp_path):
    def change(d):
        d["gpus"][3]["name"] = "NVIDIA A100-SXM4-40GB"

    line = one(differ("dgx_a100", change, tmp_path), "GPU model")
    assert "GPU3 (00000000:4E:00.0) is 'NVIDIA A100-SXM4-40GB'" in line and "'NVIDIA A100-SXM4-80GB'" in line


def test_gpu_memory_and_its_tolerance(tmp_path):
    def smaller(d):
        d["gpus"][5]["memory_total"] = 40 * 2**30
        d["gpus"][6]["memory_total"] = 40 * 2**30

    line = one(differ("dgx_a100", smaller, tmp_path), "GPU memory")
    assert "GPU5,GPU6" in line and "40960 MiB" in line and "81920 MiB" in line

    def few_mib_lower(d):  # driver reservations and ECC: a few MiB (and up to 2%) are not a mismatch
        for g in d["gpus"]:
            g["memory_total"] -= 5 * 2**20
        d["gpus"][0]["memory_total"] = int(81920 * 2**20 * 0.99)

    assert differ("dgx_a100", few_mib_lower, tmp_path / "b") == []


def test_nvlink_count_between_a_pair(tmp_path):
    def one_link_down(d):
        d["gpus"][2]["nvlinks_down"] = [7]

    line = one(differ("dgx_a100", one_link_down, tmp_path), "NVLink count")
    for pair in ("GPU0-GPU2", "GPU1-GPU2", "GPU2-GPU3", "GPU2-GPU7"):
        assert pair in line, line
    assert line.startswith("NVLink count: NV11 between GPU0-GPU2, ") and "profile expects NV12" in line
    assert "GPU0-GPU1" not in line and "more" not in line

    def bridge_missing(d):
        d["gpus"][2]["nvlinks"] = []
        d["gpus"][3]["nvlinks"] = []

    line = one(differ("pcie_4gpu_nvlink_pairs", bridge_missing, tmp_path / "b"), "NVLink count")
    assert line == "NVLink count: no NVLink between GPU2-GPU3, profile expects NV12"


def test_pcie_path_class(tmp_path):
    def change(d):
        d["common_ancestor"][0][1] = d["common_ancestor"][1][0] = "PHB"

    line = one(differ("dgx_a100", change, tmp_path), "PCIe path")
    assert line == "PCIe path: PHB between GPU0-GPU1, profile expects PXB"


def test_p2p(tmp_path):
    def change(d):
        d["p2p"][2][3] = d["p2p"][3][2] = False

    line = one(differ("pcie_4gpu_nvlink_pairs", change, tmp_path), "P2P")
    assert line == "P2P: unsupported between GPU2-GPU3, profile expects supported"


def test_numa_node(tmp_path):
    def change(d):
        d["gpus"][6]["numa_node"] = d["gpus"][7]["numa_node"] = 4

    line = one(differ("dgx_a100", change, tmp_path), "NUMA node")
    assert "GPU6,GPU7" in line and "on NUMA node 4, profile expects 5" in line


def test_pcie_link_maxima_not_current_generation(tmp_path):
    def narrow(d):
        d["gpus"][1]["pcie_max"] = [4, 8]

    line = one(differ("dgx_a100", narrow, tmp_path), "PCIe link")
    assert "GPU1 (00000000:0F:00.0) is Gen4 x8 at most, profile expects Gen4 x16" in line

    def idle(d):  # the current link drops to Gen1 at idle: not a mismatch
        for g in d["gpus"]:
            g["pcie_current"] = [1, 16]

    assert differ("dgx_a100", idle, tmp_path / "b") == []


def test_nic_rate_down_and_missing(tmp_path):
    def slow(d):
        d["nics"][3]["ports"]["1"]["rate"] = "100 Gb/sec (4X EDR)"

    line = one(differ("dgx_a100", slow, tmp_path), "NIC")
    assert line == "NIC: mlx5_3 near GPU2,GPU3 runs at 100 Gb/s, profile expects 200 Gb/s"

    def down(d):
        d["nics"][0]["ports"]["1"]["state"] = "1: DOWN"

    assert "mlx5_0 near GPU0,GPU1 is down" in one(differ("dgx_a100", down, tmp_path / "b"), "NIC")

    def gone(d):
        del d["nics"][7]

    assert "1 of 2 NICs at 200 Gb/s near GPU6,GPU7 not found" in one(differ("dgx_a100", gone, tmp_path / "c"), "NIC")

    def extra(d):  # a storage NIC the profile does not list is not a mismatch
        d["nics"].append({**d["nics"][0], "name": "mlx5_4", "sysfs_path": "pci0000:20/0000:20:01.0/0000:21:00.0"})

    assert differ("dgx_a100", extra, tmp_path / "d") == []


def test_several_classes_at_once_one_line_each(tmp_path):
    def change(d):
        d["gpus"][0]["name"] = "NVIDIA A100-SXM4-40GB"
        d["gpus"][0]["memory_total"] = 40 * 2**30
        d["gpus"][4]["nvlinks_down"] = [0, 1]
        d["nics"][2]["ports"]["1"]["rate"] = "100 Gb/sec (4X EDR)"

    lines = differ("dgx_a100", change, tmp_path, env={"GROUP_WORLD_SIZE": "2"})
    assert [l.split(":")[0] for l in lines] == ["node count", "GPU model", "GPU memory", "NVLink count", "NIC"]


def test_cpu_machine_against_a_gpu_profile(tmp_path):
    lines = mismatches(load_profile("dgx_a100"), live(None, tmp_path))
    assert lines == [
        "GPU count: profile 'dgx_a100' expects 8 GPUs per node (NVIDIA A100-SXM4-80GB); this node has none",
        "NIC: profile 'dgx_a100' expects 8 NICs at 200 Gb/s; this node has none",
    ]
    assert mismatches(load_profile("cpu"), live(fixture("dgx_a100"), tmp_path / "g")) == []  # CPU profiles run anywhere


def test_version_1_profiles_of_older_artifacts_are_still_checked(tmp_path):
    v1 = {
        "schema": "aot-topology",
        "schema_version": 1,
        "name": "live",
        "device_kind": "cuda",
        "backend": "nccl",
        "nodes": 1,
        "node": {"gpus": [{"index": 0, "name": "NVIDIA L40S", "memory_bytes": 48305799168}]},
    }
    machine = live(fixture("pcie_8gpu"), tmp_path, {"CUDA_VISIBLE_DEVICES": "3"})
    assert mismatches(v1, machine) == []
    assert one(mismatches(v1, live(fixture("pcie_8gpu"), tmp_path / "b")), "GPU count")
    v1cpu = {"schema": "aot-topology", "schema_version": 1, "name": "cpu", "device_kind": "cpu", "backend": "gloo", "nodes": 1, "node": {"gpus": []}}
    assert mismatches(v1cpu, machine) == []


# -- the start-up check ---------------------------------------------------------------------------


def test_verify_live_refuses_then_allows_with_a_warning(tmp_path):
    machine = live(None, tmp_path)
    with pytest.raises(TopologyMismatch) as e:
        verify_live(load_profile("dgx_a100"), live=machine, env={"LOCAL_RANK": "0"})
    assert len(e.value.lines) == 2 and e.value.report
    assert "GPU count" in str(e.value) and "\n" not in str(e.value)
    assert "2 ways (listed above)" in e.value.summary and "--allow-topology-mismatch" in e.value.summary
    with pytest.raises(TopologyMismatch) as e:
        verify_live(load_profile("dgx_a100"), live=machine, env={"LOCAL_RANK": "3"})
    assert not e.value.report and "local rank 0" in e.value.summary
    warnings = []
    lines = verify_live(load_profile("dgx_a100"), allow_mismatch=True, warn=warnings.append, live=machine, env={})
    assert len(lines) == 2 and "tuned for other hardware" in warnings[0] and warnings[1:] == [f"topology mismatch: {l}" for l in lines]
    quiet = []
    verify_live(load_profile("dgx_a100"), allow_mismatch=True, warn=quiet.append, live=machine, env={"LOCAL_RANK": "1"})
    assert quiet == []  # one report per node
