"""Topology profiles as files: the built-ins, the schema's checks, `--nodes`, and `aot topology`.

Command-line tests run the real `python -m aot topology ...` (no torch import: each takes a
fraction of a second). Where a command needs GPUs, a fake `pynvml` (tests/fixtures/topology/
pynvml_shim) is put first on the subprocess's PYTHONPATH; aot itself is not changed for tests.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.topology.fake_nvml import HERE as FIXTURES, fixture
from helpers.commands import REPO, TIMEOUT, aot, clean_env, show
from runner.errors import AotError
from runner.hardware.topology import (
    builtin_names,
    describe,
    dumps_profile,
    for_nodes,
    gpus_in_order,
    load_profile,
    normalize_bus_id,
    pair_links,
    profile_sha256,
)
from runner.hardware.topology_check import mismatches

BUILTINS = ["cpu", "dgx_a100", "dgx_h100", "hgx_h200", "pcie_4gpu_nvlink_pairs"]


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 1, show(r)
    assert "Traceback" not in r.stderr + r.stdout and "internal error" not in r.stderr, show(r)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len([l for l in lines if l.startswith("aot: error: ")]) == 1 and lines[-1].startswith("aot: error: "), show(r)
    for needle in needles:
        assert needle in lines[-1], f"{needle!r} not in {lines[-1]!r}"
    return lines[-1]


def aot_with_fake_nvml(machine: str | Path | None, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m aot ARGS` on a machine whose NVML is the fake one serving `machine` (None: no NVML)."""
    e = clean_env()
    e["PYTHONPATH"] = os.pathsep.join([str(FIXTURES / "pynvml_shim"), e["PYTHONPATH"]])
    path = FIXTURES / f"{machine}.json" if isinstance(machine, str) else machine
    e["AOT_TEST_FAKE_NVML"] = str(path) if path else "none"
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "aot", *map(str, args)], cwd=REPO, env=e, capture_output=True, text=True, timeout=TIMEOUT)


# -- built-in profiles ---------------------------------------------------------------------------


def test_builtin_names():
    assert builtin_names() == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_are_valid_canonical_and_stable(name):
    p = load_profile(name)
    assert p["schema"] == "aot-topology" and p["schema_version"] == 2 and p["name"] == name and p["nodes"] == 1
    raw = json.loads((REPO / "runner" / "hardware" / "profiles" / f"{name}.json").read_text())
    assert raw == p  # stored with bus ids already canonical
    assert dumps_profile(p) == (REPO / "runner" / "hardware" / "profiles" / f"{name}.json").read_text()
    assert profile_sha256(p) == profile_sha256(load_profile(name))
    if p["device_kind"] == "cuda":
        n = len(p["node"]["gpus"])
        assert len(pair_links(p)) == n * (n - 1) // 2  # every pair stated


def test_builtin_facts_per_the_hardware_reference():
    a100 = load_profile("dgx_a100")
    assert [g["numa_node"] for _, g in gpus_in_order(a100)] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert all(l["nvlink"]["count"] == 12 and l["nvlink"]["via"] == "nvswitch" for l in pair_links(a100).values())
    assert a100["node"]["nvswitches"] == 6 and len(a100["node"]["nics"]) == 8
    assert {n["rate_gbit_per_s"] for n in a100["node"]["nics"]} == {200.0}
    assert {l["pcie_path"] for (i, j), l in pair_links(a100).items() if i // 2 == j // 2} == {"PXB"}
    g = gpus_in_order(a100)[0][1]
    assert g["peak_tflops"]["bf16"] == 312 and g["compute_capability"] == [8, 0] and g["memory_bytes"] == 80 * 2**30
    h100, h200 = load_profile("dgx_h100"), load_profile("hgx_h200")
    for p in (h100, h200):
        assert {l["nvlink"]["count"] for l in pair_links(p).values()} == {18}
        assert {l["nvlink"]["gb_per_s_per_direction"] for l in pair_links(p).values()} == {450.0}
        assert [g["numa_node"] for _, g in gpus_in_order(p)] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert p["node"]["nvswitches"] == 4 and p["fabric"]["gb_per_s_per_rail"] == 50.0
    assert gpus_in_order(h200)[0][1]["memory_bandwidth_gb_per_s"] == 4800
    assert gpus_in_order(h100)[0][1]["peak_tflops"]["fp8"] == 1979
    pairs = pair_links(load_profile("pcie_4gpu_nvlink_pairs"))
    assert {k for k, l in pairs.items() if l["nvlink"]} == {(0, 1), (2, 3)}
    assert pairs[(0, 2)]["pcie_path"] == "SYS" and pairs[(0, 2)]["p2p"] is False
    cpu = load_profile("cpu")
    assert cpu["device_kind"] == "cpu" and cpu["backend"] == "gloo" and cpu["node"]["gpus"] == {}


def test_describe():
    assert describe(load_profile("dgx_a100")) == "1 node x 8 NVIDIA A100-SXM4-80GB, NV12 all pairs via 6 NVSwitches, 8x 200 Gb/s NICs"
    assert describe(load_profile("pcie_4gpu_nvlink_pairs")).endswith("NVLink on 2 of 6 pairs, 2x 400 Gb/s NICs")


# -- the schema's checks: one line naming the file and the field ------------------------------------


def broken(tmp_path, change, base="dgx_a100") -> Path:
    p = copy.deepcopy(load_profile(base))
    change(p)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(p))
    return path


G0 = "00000000:07:00.0"


@pytest.mark.parametrize(
    "change, needles",
    [
        (lambda p: p["node"]["gpus"][G0].pop("memory_bytes"), [f"'node.gpus.{G0}.memory_bytes' is missing"]),
        (lambda p: p.pop("nodes"), ["field 'nodes' is missing"]),
        (lambda p: p.update(nodes=0), ["'nodes' must be a positive integer (got 0)"]),
        (lambda p: p["node"]["gpus"][G0].update(numa_node=-1), [f"'node.gpus.{G0}.numa_node' must be an integer in 0..4095 or null", "(got -1)"]),
        (lambda p: p["node"]["gpus"][G0].update(memory_bytes=0), ["memory_bytes' must be an integer >= 1 (got 0)"]),
        (lambda p: p["node"]["gpus"][G0]["pcie"].update(width=3), ["pcie.width' must be one of 1, 2, 4, 8, 16, 32 (got 3)"]),
        (lambda p: p["node"]["gpus"][G0]["pcie"].update(generation=9), ["pcie.generation' must be an integer in 1..7 (got 9)"]),
        (lambda p: p["node"]["gpus"][G0].update(compute_capability="8.0"), ["compute_capability' must be [major, minor]"]),
        (lambda p: p["node"]["gpus"][G0]["peak_tflops"].update(fp4=1.0), ["unknown dtype 'fp4'"]),
        (lambda p: p["node"]["gpus"][G0].update(cpu_affinity="0-3,x"), ["cpu_affinity' must be a cpulist"]),
        (lambda p: p["node"]["gpus"][G0].update(index=5), ["'node.gpus' indices must be 0..7, each once"]),
        (lambda p: p["node"]["links"][0]["nvlink"].update(count=0), ["'node.links[0].nvlink.count' must be an integer in 1..72 (got 0)"]),
        (lambda p: p["node"]["links"][0].update(pcie_path="PCI"), ["'node.links[0].pcie_path' must be one of PIX, PXB, PHB, NODE, SYS"]),
        (lambda p: p["node"]["links"][0].update(gpus=[G0, "00000000:99:00.0"]), ["names a GPU not in node.gpus"]),
        (lambda p: p["node"]["links"][1].update(gpus=p["node"]["links"][0]["gpus"][::-1]), ["repeats a GPU pair"]),
        (lambda p: p["node"]["nics"][0].update(rate_gbit_per_s=-200), ["'node.nics[0].rate_gbit_per_s' must be a number >= 0"]),
        (lambda p: p["node"]["gpus"].update({"07:00": {}}), ["key '07:00' of field 'node.gpus' must be a PCI bus id"]),
        (lambda p: p.update(backend="gloo"), ["'backend' must be 'nccl' for device_kind 'cuda'"]),
        (lambda p: p.update(device_kind="tpu"), ["'device_kind' must be one of cpu, cuda"]),
        (lambda p: p.update(schema_version=3), ["topology schema version 3", "reads versions 1, 2"]),
        (lambda p: p["node"].update(gpus={}), ["'node.gpus' must list at least one GPU for device_kind 'cuda'"]),
        (lambda p: p["fabric"].update(rails_per_node=-1), ["'fabric.rails_per_node' must be an integer in 0..64"]),
        (lambda p: p.update(calibration={"nvlink": {"alpha_s": 5e-6}}), ["'calibration.nvlink.beta_s_per_byte' is missing"]),
        (lambda p: p.update(calibration={"infiniband": {"alpha_s": 1, "beta_s_per_byte": 1}}), ["unknown link class 'infiniband'"]),
    ],
)
def test_bad_profile_is_one_line_naming_the_field(tmp_path, change, needles):
    path = broken(tmp_path, change)
    with pytest.raises(AotError) as e:
        load_profile(str(path))
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_bus_ids_are_canonicalised_on_load(tmp_path):
    def lower(p):
        p["node"]["gpus"] = {k.lower()[4:]: v for k, v in p["node"]["gpus"].items()}  # 0000:07:00.0 spelling

    p = load_profile(str(broken(tmp_path, lower)))
    assert list(p["node"]["gpus"])[0] == G0 and p == load_profile("dgx_a100")
    assert normalize_bus_id("0000:bd:00.0") == "00000000:BD:00.0" and normalize_bus_id("07:00.0") == G0


def test_profile_from_an_artifact_folder(tmp_path):
    folder = tmp_path / "art"
    folder.mkdir()
    profile = load_profile("pcie_4gpu_nvlink_pairs")
    manifest = {"topology": {"name": profile["name"], "sha256": profile_sha256(profile), "profile": profile}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert load_profile(str(folder)) == profile
    manifest["topology"]["profile"]["nodes"] = 2
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AotError, match="does not match its sha256"):
        load_profile(str(folder))


# -- nodes and world size ----------------------------------------------------------------------------


def test_for_nodes():
    a100 = load_profile("dgx_a100")
    assert for_nodes(a100, None, 8) is a100
    assert for_nodes(a100, 4, 32)["nodes"] == 4 and a100["nodes"] == 1
    assert for_nodes(load_profile("cpu"), 2, 6)["nodes"] == 2
    for nodes, world, needle in [
        (0, 8, "--nodes must be at least 1"),
        (2, 3, "does not split evenly over the 2 nodes"),
        (None, 16, "16 ranks per node, but topology 'dgx_a100' has 8 GPU(s) per node"),
        (4, 2, "fewer ranks than the 4 nodes"),
    ]:
        with pytest.raises(AotError, match=re.escape(needle)):
            for_nodes(a100, nodes, world)
    with pytest.raises(AotError, match="use --nodes 2"):
        for_nodes(a100, None, 16)


def test_node_count_mismatch_line():
    two = for_nodes(load_profile("cpu"), 2)
    assert mismatches(two, load_profile("cpu")) == ["node count: profile 'cpu' is for 2 nodes; this job runs on 1"]
    assert mismatches(two, load_profile("cpu"), check_nodes=False) == []


# -- aot topology show / verify / probe, and aot build --nodes -----------------------------------------


def test_show_prints_the_matrix_with_bandwidths():
    r = aot("topology", "show", "dgx_a100")
    assert r.returncode == 0, show(r)
    lines = r.stdout.splitlines()
    header = next(l for l in lines if l.lstrip().startswith("GPU0") and "CPU Affinity" in l).split()
    assert header[:9] == [f"GPU{i}" for i in range(8)] + ["NIC0"]
    row0 = next(l for l in lines if l.startswith("GPU0 ")).split()
    assert row0[:11] == ["GPU0", "X"] + ["NV12"] * 7 + ["PXB", "PXB"] and row0[-2:] == ["48-63,176-191", "3"]
    assert any(l.split()[:3] == ["GPU3", "300", "300"] for l in lines)  # the GB/s matrix
    assert "NIC0: mlx5_0" in r.stdout and "8 rail(s) per node at 25 GB/s each" in r.stdout
    assert "PXB  = Connection traversing multiple PCIe bridges" in r.stdout
    r = aot("topology", "show", "pcie_4gpu_nvlink_pairs")
    row = next(l for l in r.stdout.splitlines() if l.startswith("GPU0 ") and "host" in l).split()
    assert row == ["GPU0", "X", "300", "host", "host"]


def test_show_json_and_nodes(tmp_path):
    r = aot("topology", "show", "hgx_h200", "--json", "--nodes", "4")
    assert r.returncode == 0, show(r)
    p = json.loads(r.stdout)
    assert p["nodes"] == 4 and {**p, "nodes": 1} == load_profile("hgx_h200")
    assert_one_line_error(aot("topology", "show", "dgx_b200"), "'dgx_b200'", "built-in: cpu, dgx_a100, dgx_h100, hgx_h200, pcie_4gpu_nvlink_pairs")
    bad = broken(tmp_path, lambda p: p["node"]["gpus"][G0].update(numa_node="three"))
    assert_one_line_error(aot("topology", "show", bad), str(bad), "numa_node", '"three"')


def test_verify_on_this_cpu_machine():
    r = aot("topology", "verify", "cpu")
    assert r.returncode == 0 and "matches topology 'cpu'" in r.stdout, show(r)
    r = aot("topology", "verify", "dgx_a100")
    assert_one_line_error(r, "differs from topology 'dgx_a100' in 2 ways")
    assert r.stdout.splitlines() == [
        "mismatch: GPU count: profile 'dgx_a100' expects 8 GPUs per node (NVIDIA A100-SXM4-80GB); this node has none",
        "mismatch: NIC: profile 'dgx_a100' expects 8 NICs at 200 Gb/s; this node has none",
    ]
    r = aot("topology", "verify", "cpu", "--nodes", "2", "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["mismatches"] == ["node count: profile 'cpu' is for 1 node; this job runs on 2"], show(r)


def test_probe_on_this_cpu_machine_writes_its_cpu_profile(tmp_path):
    out = tmp_path / "here.json"
    r = aot("topology", "probe", "-o", out, "--name", "ci-box")
    assert r.returncode == 0, show(r)
    p = load_profile(str(out))
    assert p["name"] == "ci-box" and p["device_kind"] == "cpu" and p["node"]["gpus"] == {}
    assert p["node"]["cpu"]["logical_cpus"] == os.cpu_count()
    assert "wrote 'ci-box'" in r.stderr
    assert aot("topology", "verify", out).returncode == 0
    assert_one_line_error(aot("topology", "probe", "-o", out / "x.json"), "is a file, not a folder")


def test_probe_and_verify_with_a_fake_dgx(tmp_path):
    out = tmp_path / "dgx.json"
    r = aot_with_fake_nvml("dgx_a100", "topology", "probe", "-o", out, "--quiet")
    assert r.returncode == 0, show(r)
    probed = load_profile(str(out))
    assert len(probed["node"]["gpus"]) == 8 and probed["probe"]["source"] == "nvml"
    assert mismatches(load_profile("dgx_a100"), probed) == [
        "NIC: profile 'dgx_a100' expects 8 NICs at 200 Gb/s; this node has none"
    ]  # this host's /sys has no HCAs
    r = aot_with_fake_nvml("dgx_a100", "topology", "verify", out)
    assert r.returncode == 0 and "matches" in r.stdout, show(r)
    degraded = fixture("dgx_a100")
    degraded["gpus"][4]["nvlinks_down"] = [0, 5]
    degraded["gpus"][7]["memory_total"] = 40 * 2**30
    (tmp_path / "degraded.json").write_text(json.dumps(degraded))
    r = aot_with_fake_nvml(tmp_path / "degraded.json", "topology", "verify", out)
    assert_one_line_error(r, "in 2 ways")
    assert [l.split(":")[1].strip() for l in r.stdout.splitlines()] == ["GPU memory", "NVLink count"]
    assert "GPU7 (00000000:BD:00.0) is 40960 MiB" in r.stdout and "NV10 between GPU0-GPU4" in r.stdout
    # a subset and a reordering through CUDA_VISIBLE_DEVICES
    r = aot_with_fake_nvml("dgx_a100", "topology", "show", "--json", env={"CUDA_VISIBLE_DEVICES": "5,2"})
    p = json.loads(r.stdout)
    assert [bus for bus, _ in gpus_in_order(p)] == ["00000000:90:00.0", "00000000:47:00.0"]


@pytest.mark.parametrize("cvd, needle", [("8", "entry '8' names no GPU"), ("GPU-nope", "'GPU-nope' names no GPU"), ("0,0", "a second time")])
def test_visible_devices_naming_no_gpu_from_the_command_line(tmp_path, cvd, needle):
    r = aot_with_fake_nvml("dgx_a100", "topology", "probe", env={"CUDA_VISIBLE_DEVICES": cvd})
    assert_one_line_error(r, f"CUDA_VISIBLE_DEVICES={cvd}", needle)
    assert r.stdout == ""


def test_probe_without_nvml_library(tmp_path):
    r = aot_with_fake_nvml(None, "topology", "probe")
    assert r.returncode == 0, show(r)
    assert json.loads(r.stdout)["device_kind"] == "cpu" and "note: NVML unavailable" in r.stderr


def test_build_nodes_is_checked_before_any_work(tmp_path):
    from aot.build import BuildOptions, build
    from aot.progress import Progress

    options = BuildOptions(model_path=REPO / "examples" / "mlp.py", output=tmp_path / "a", topology="dgx_a100", world_size=16, nodes=1)
    with pytest.raises(AotError, match="16 ranks per node.*use --nodes 2"):
        build(options, Progress(total=6, quiet=True))
    assert not (tmp_path / "a").exists()
    r = aot("build", "--help")
    assert "--nodes" in r.stdout, show(r)
