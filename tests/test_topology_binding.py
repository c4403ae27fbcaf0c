"""Per-rank CPU/NUMA binding: the CPUs and memory node nearest a rank's GPU, from NVML or sysfs.

The affinity setters are parameters, so these tests bind nothing in the test process; the fake
NVML and fake /sys describe a DGX A100 (GPU0/1 on NUMA node 3: CPUs 48-63,176-191).
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fixtures.topology.fake_nvml import FakeNvml, fixture, make_root
from helpers.commands import REPO, clean_env
from runner.hardware.binding import bind_gpu, bind_rank, gpu_locality, set_thread_affinity

GPU0, GPU7 = "00000000:07:00.0", "00000000:BD:00.0"
NUMA3 = set(range(48, 64)) | set(range(176, 192))


@pytest.fixture
def dgx(tmp_path):
    data = fixture("dgx_a100")
    return data, make_root(data, tmp_path / "root")


class Recorder:
    def __init__(self, memory_result=None):
        self.cpus, self.memory, self.memory_result, self.log = None, None, memory_result, []

    def set_affinity(self, cpus):
        self.cpus = set(cpus)

    def set_memory(self, node):
        self.memory = node
        return self.memory_result


def bind(data, root, rec: Recorder, bus=GPU0, allowed=None, nvml=True):
    return bind_gpu(
        bus,
        log=rec.log.append,
        nvml=FakeNvml(data) if nvml else FakeNvml(None, init_error=12),
        root=root,
        allowed=set(range(256)) if allowed is None else allowed,
        set_affinity=rec.set_affinity,
        set_memory=rec.set_memory,
    )


def test_locality_from_nvml_and_from_sysfs(dgx):
    data, root = dgx
    assert gpu_locality(GPU0, nvml=FakeNvml(data), root=root) == (NUMA3, 3, "NVML")
    assert gpu_locality(GPU0, nvml=FakeNvml(None, init_error=12), root=root) == (NUMA3, 3, "sysfs")
    cpus, node, _ = gpu_locality("0000:bd:00.0", nvml=FakeNvml(data), root=root)  # sysfs spelling accepted
    assert node == 5 and min(cpus) == 80


def test_binds_cpus_and_prefers_the_memory_node(dgx):
    data, root = dgx
    rec = Recorder()
    result = bind(data, root, rec)
    assert rec.cpus == NUMA3 and rec.memory == 3
    assert result == {"gpu": GPU0, "cpus": "48-63,176-191", "numa_node": 3, "memory_node": 3, "bound": True}
    assert rec.log == ["bound to CPUs 48-63,176-191 (NUMA node 3); memory preferred on NUMA node 3 [NVML affinity]"]


def test_without_nvml_sysfs_gives_the_same_binding(dgx):
    data, root = dgx
    rec = Recorder()
    bind(data, root, rec, bus=GPU7, nvml=False)
    assert rec.cpus == set(range(80, 96)) | set(range(208, 224)) and rec.memory == 5
    assert rec.log[0].endswith("[sysfs affinity]")


def test_restricted_process_binds_to_the_intersection(dgx):
    data, root = dgx
    rec = Recorder()
    bind(data, root, rec, allowed=set(range(40, 56)))
    assert rec.cpus == set(range(48, 56))
    assert "bound to CPUs 48-55 of its 48-63,176-191" in rec.log[0]


def test_no_allowed_cpu_near_the_gpu_leaves_it_unbound(dgx):
    data, root = dgx
    rec = Recorder()
    result = bind(data, root, rec, allowed={0, 1})
    assert rec.cpus is None and rec.memory is None and not result["bound"]
    assert rec.log == ["not bound: the CPUs nearest this GPU (48-63,176-191) are outside this process's allowed CPUs (0-1)"]


def test_memory_policy_failure_is_reported_not_fatal(dgx):
    data, root = dgx
    rec = Recorder(memory_result="set_mempolicy failed: Operation not permitted")
    result = bind(data, root, rec)
    assert result["bound"] and result["memory_node"] is None
    assert "memory policy unchanged (set_mempolicy failed: Operation not permitted)" in rec.log[0]


def test_single_numa_node_machine_sets_no_memory_policy(tmp_path):
    data = fixture("pcie_8gpu")
    data["cpu"]["numa_nodes"] = {"0": "0-127"}
    data["cpu"]["sockets"] = 1
    for g in data["gpus"]:
        g["numa_node"], g["cpu_affinity"] = 0, "0-127"
    root = make_root(data, tmp_path)
    rec = Recorder()
    bind(data, root, rec, bus="00000000:18:00.0", allowed=set(range(128)))
    assert rec.cpus == set(range(128)) and rec.memory is None


def test_bind_rank_only_for_cuda_ranks_and_not_with_no_bind():
    log = []
    assert bind_rank(SimpleNamespace(type="cpu", index=None), log=log.append) is None and log == []
    assert bind_rank(SimpleNamespace(type="cuda", index=0, __str__=None), enabled=False, log=log.append) is None
    assert "binding off (--no-bind)" in log[0]


def test_real_affinity_and_memory_policy_calls_work_here():
    """The syscalls themselves, in a child process: bind to the CPUs already allowed, prefer node 0."""
    code = (
        "import os; from runner.hardware.binding import set_thread_affinity, prefer_memory_node;"
        "cpus = os.sched_getaffinity(0); set_thread_affinity(cpus); assert os.sched_getaffinity(0) == cpus;"
        "print(prefer_memory_node(0))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if os.uname().machine in ("x86_64", "aarch64"):
        assert r.stdout.strip() == "None"
    set_thread_affinity(os.sched_getaffinity(0))  # a no-op binding of the test process itself
