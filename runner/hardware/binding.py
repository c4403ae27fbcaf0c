"""Per-rank CPU and memory binding: a rank runs on the cores nearest its GPU and allocates from
that GPU's NUMA node.

The CPUs come from NVML's affinity for the GPU (nvmlDeviceGetCpuAffinity), else the kernel's
/sys/bus/pci/devices/<bdf>/local_cpulist; the NUMA node from nvmlDeviceGetMemoryAffinity, else
.../numa_node. The binding is intersected with the CPUs this process may use (taskset, cgroups,
Slurm), applied to every thread of the process, and memory is set to *prefer* (not require) the
GPU's node, so a full node spills over instead of failing. Nothing here is fatal: a rank that
cannot bind says why and runs unbound. `aot run --no-bind` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

from runner.hardware.nvml_probe import _bits, _call, _const, _cpu_words, _numa, _read, _read_int, import_nvml
from runner.hardware.sysfs import format_cpulist, normalize_bus_id, parse_cpulist, sysfs_bus_id

_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261}  # syscall numbers
_MPOL_PREFERRED = 1


def gpu_bus_id(device) -> str | None:
    """The PCI bus id of a torch CUDA device, as NVML spells it."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if hasattr(props, "pci_bus_id"):
        return f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
    from runner.hardware.nvml_probe import probe  # an old torch: CUDA's device order as the probe derives it

    gpus = probe(nodes=1, name="binding")["node"]["gpus"]
    return next((bus for bus, g in gpus.items() if g["index"] == index), None)


def gpu_locality(bus_id: str, *, nvml=None, root: str | Path = "/") -> tuple[set[int], int | None, str]:
    """(CPUs nearest the GPU, its NUMA node, where that came from)."""
    root = Path(root)
    bus_id = normalize_bus_id(bus_id)
    cpus: set[int] = set()
    node = None
    source = "sysfs"
    lib = nvml if nvml is not None else import_nvml()
    if lib is not None:
        try:
            lib.nvmlInit()
        except Exception as e:
            if not isinstance(e, getattr(lib, "NVMLError", ())):
                raise
        else:
            try:
                handle = _call(lib, "nvmlDeviceGetHandleByPciBusId", bus_id.encode())
                if handle is not None:
                    words = _call(lib, "nvmlDeviceGetCpuAffinity", handle, _cpu_words(root))
                    cpus = _bits(words) if words is not None else set()
                    nodes = _call(lib, "nvmlDeviceGetMemoryAffinity", handle, 4, _const(lib, "NVML_AFFINITY_SCOPE_NODE", 0))
                    nodes = sorted(_bits(nodes)) if nodes is not None else []
                    node = nodes[0] if len(nodes) == 1 else None
                    source = "NVML"
            finally:
                try:
                    lib.nvmlShutdown()
                except Exception:
                    pass
    device = root / "sys" / "bus" / "pci" / "devices" / sysfs_bus_id(bus_id)
    if not cpus:
        text = _read(device / "local_cpulist")
        cpus = parse_cpulist(text) if text else set()
    if node is None:
        node = _numa(_read_int(device / "numa_node"))
    return cpus, node, source


def set_thread_affinity(cpus: set[int]) -> None:
    """Pin every thread of this process (threads started later inherit it)."""
    os.sched_setaffinity(0, cpus)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):
            pass  # a thread that has exited


def prefer_memory_node(node: int) -> str | None:
    """set_mempolicy(MPOL_PREFERRED, {node}) for this thread and the threads it starts; None on
    success, else why not."""
    number = _SET_MEMPOLICY.get(platform.machine())
    if number is None:
        return f"set_mempolicy is not known on {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(number), ctypes.c_int(_MPOL_PREFERRED), mask, ctypes.c_ulong(64 * words + 1)) != 0:
        return f"set_mempolicy failed: {os.strerror(ctypes.get_errno())}"
    return None


def numa_node_count(root: str | Path = "/") -> int:
    try:
        return sum(1 for n in os.listdir(Path(root) / "sys" / "devices" / "system" / "node") if n.startswith("node") and n[4:].isdigit())
    except OSError:
        return 1


def bind_gpu(
    bus_id: str,
    *,
    log=lambda msg: None,
    nvml=None,
    root: str | Path = "/",
    allowed: set[int] | None = None,
    set_affinity=set_thread_affinity,
    set_memory=prefer_memory_node,
) -> dict:
    """Bind this process to the CPUs and memory node nearest GPU `bus_id`; returns what was done."""
    cpus, node, source = gpu_locality(bus_id, nvml=nvml, root=root)
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    result = {"gpu": normalize_bus_id(bus_id), "cpus": None, "numa_node": node, "memory_node": None, "bound": False}
    if not cpus:
        log("not bound: the CPUs nearest this GPU are unknown (no NVML affinity and no sysfs local_cpulist)")
        return result
    target = cpus & allowed
    if not target:
        log(f"not bound: the CPUs nearest this GPU ({format_cpulist(cpus)}) are outside this process's allowed CPUs ({format_cpulist(allowed)})")
        return result
    try:
        set_affinity(target)
    except OSError as e:
        log(f"not bound: sched_setaffinity failed ({e.strerror})")
        return result
    result.update(cpus=format_cpulist(target), bound=True)
    partial = f" of its {format_cpulist(cpus)}" if target != cpus else ""
    memory = ""
    if node is not None and numa_node_count(root) > 1:
        problem = set_memory(node)
        if problem is None:
            result["memory_node"] = node
            memory = f"; memory preferred on NUMA node {node}"
        else:
            memory = f"; memory policy unchanged ({problem})"
    where = f" (NUMA node {node})" if node is not None else ""
    log(f"bound to CPUs {format_cpulist(target)}{partial}{where}{memory} [{source} affinity]")
    return result


def bind_rank(device, *, enabled: bool = True, log=lambda msg: None, nvml=None, root: str | Path = "/") -> dict | None:
    """The binding step of a rank, right after its device is chosen: CUDA ranks only."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    if not enabled:
        log(f"{device}: CPU/NUMA binding off (--no-bind)")
        return None
    try:
        bus = gpu_bus_id(device)
    except Exception as e:  # binding is an optimisation: never the reason a run fails
        log(f"{device}: not bound: cannot read its PCI bus id ({type(e).__name__}: {e})")
        return None
    if bus is None:
        log(f"{device}: not bound: its PCI bus id is unknown")
        return None
    say = lambda msg: log(f"{device} ({bus}): {msg}")  # noqa: E731
    try:
        return bind_gpu(bus, log=say, nvml=nvml, root=root)
    except Exception as e:
        say(f"not bound: {type(e).__name__}: {e}")
        return None
