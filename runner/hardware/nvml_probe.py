"""The live machine as a topology profile: GPUs through NVML, NICs and CPUs from sysfs.

`probe()` reads GPUs with nvidia-ml-py (`import pynvml`; the module is a parameter, so tests pass
a fake with the same functions): PCI bus ids, UUIDs, names, compute capability, memory, maximum
PCIe link, NVLink state and remote ends (NVSwitch included), P2P status, the common PCIe ancestor
of every pair, CPU and memory affinity. NICs (RDMA devices: InfiniBand and RoCE) come from
/sys/class/infiniband, their distance to GPUs from the PCI tree in sysfs. The GPUs listed are those
CUDA would show this process: CUDA_VISIBLE_DEVICES (indices or UUIDs) applied in
CUDA_DEVICE_ORDER, each GPU's `index` being its CUDA device number. With no GPU, no NVML and no
CUDA, the result is this machine's CPU profile.

Traps handled here (see ../shared/reference/hardware.md): NVML numbers GPUs in PCI order and
ignores CUDA_VISIBLE_DEVICES; on NVSwitch systems NVLinks end at switches, never at peer GPUs;
the current PCIe generation drops when idle (maxima are read); the NUMA node comes from memory
affinity (nvmlDeviceGetNumaNodeId is N/A on x86) with sysfs as fallback; pynvml spells some
constants as 1-tuples and returns bus ids as bytes.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
from pathlib import Path
from typing import TypedDict

from runner.errors import AotError
from runner.hardware.sysfs import format_cpulist, normalize_bus_id, parse_cpulist, sysfs_bus_id
from runner.hardware.topology import (
    BACKENDS,
    PCIE_PATHS,
    SCHEMA,
    SCHEMA_VERSION,
    describe,
    job_nodes,
    load_profile,
    validate_profile,
)


class KnownGpu(TypedDict, total=False):
    memory_bandwidth_gb_per_s: float
    peak_tflops: dict[str, float]  # dtype -> dense peak TFLOP/s


# Datasheet figures for models NVML cannot measure (../shared/reference/hardware.md): dense peak
# TFLOP/s per dtype and memory bandwidth in GB/s. Unknown models: bandwidth from NVML (bus width x
# max memory clock x 2), no TFLOP/s.
KNOWN_GPUS: dict[str, KnownGpu] = {
    "NVIDIA A100-SXM4-80GB": {"memory_bandwidth_gb_per_s": 2039.0, "peak_tflops": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}},
    "NVIDIA A100-SXM4-40GB": {"memory_bandwidth_gb_per_s": 1555.0, "peak_tflops": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}},
    "NVIDIA H100 80GB HBM3": {"memory_bandwidth_gb_per_s": 3350.0, "peak_tflops": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0, "fp8": 1979.0}},
    "NVIDIA H200": {"memory_bandwidth_gb_per_s": 4800.0, "peak_tflops": {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0, "fp8": 1979.0}},
    "NVIDIA H100 PCIe": {"memory_bandwidth_gb_per_s": 2000.0, "peak_tflops": {"fp32": 51.0, "bf16": 756.0, "fp16": 756.0}},
}

# Per-link, per-direction NVLink bandwidth by compute capability (NVLink 1: P100; 2: V100; 3: A100
# and the GA10x bridge; 4: H100/H200; 5: B200).
NVLINK_GB_PER_S = {(6, 0): 20.0, (7, 0): 25.0, (7, 5): 25.0, (8, 0): 25.0, (8, 6): 14.0625, (9, 0): 25.0, (10, 0): 50.0, (10, 3): 50.0}

_ANCESTOR = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}  # NVML_TOPOLOGY_* -> class
_GPU, _SWITCH = 0, 2  # NVML_NVLINK_DEVICE_TYPE_*
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4}:[0-9a-fA-F]{2}$")
_SYSFS_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def import_nvml():
    """The real pynvml (package nvidia-ml-py), or None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _const(nvml, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    return value[0] if isinstance(value, tuple) else value  # pynvml: NVML_P2P_CAPS_INDEX_READ = 0,


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _call(nvml, fn: str, *args):
    """An NVML query that may be unsupported on this GPU, driver or binding: None then."""
    try:
        return getattr(nvml, fn)(*args)
    except AttributeError:
        return None
    except Exception as e:  # NVMLError and its generated subclasses
        if isinstance(e, getattr(nvml, "NVMLError", ())):
            return None
        raise


def _bits(words, width: int = 64) -> set[int]:
    out = set()
    for w, word in enumerate(words):
        word = int(word)
        for bit in range(width):
            if word >> bit & 1:
                out.add(w * width + bit)
    return out


# -- sysfs ------------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _numa(value: int | None) -> int | None:
    return value if value is not None and value >= 0 else None


def pci_chain(root: Path, sysfs_bdf: str) -> list[str] | None:
    """The PCI path of a device from its sysfs link: [host bridge, bridges..., device]."""
    path = root / "sys" / "bus" / "pci" / "devices" / sysfs_bdf
    if not path.exists():
        return None
    return chain_of(os.path.realpath(path))


def chain_of(real: str) -> list[str] | None:
    parts = Path(real).parts
    for i, part in enumerate(parts):
        if _HOST_BRIDGE.match(part):
            chain = [part] + [p for p in parts[i + 1 :] if _SYSFS_BDF.match(p)]
            return chain if len(chain) > 1 else None
    return None


def path_class(a: list[str] | None, b: list[str] | None, numa_a: int | None, numa_b: int | None) -> str | None:
    """PCIe path class between two devices from their PCI chains, as `nvidia-smi topo -m` names it."""
    if a is None or b is None:
        if numa_a is None or numa_b is None:
            return None
        return "NODE" if numa_a == numa_b else "SYS"
    if a[0] != b[0]:
        return "NODE" if numa_a == numa_b else "SYS"
    ba, bb = a[1:-1], b[1:-1]  # bridges between the host bridge and each device
    common = 0
    while common < min(len(ba), len(bb)) and ba[common] == bb[common]:
        common += 1
    if common == 0:
        return "PHB"
    below = (len(ba) - common) + (len(bb) - common)  # downstream ports under the common switch
    return "PIX" if below <= 2 else "PXB"


def _parse_rate(text: str | None) -> float | None:
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text or "")
    return float(m.group(1)) if m else None


def probe_nics(root: Path, gpus: list[dict]) -> list[dict]:
    """RDMA NIC ports (InfiniBand, RoCE) with rate, NUMA node and the GPUs nearest on the PCI tree.
    `gpus`: dicts with bus, index, numa_node and chain. A port that is not ACTIVE has rate 0."""
    base = root / "sys" / "class" / "infiniband"
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return []
    nics = []
    for dev in devices:
        d = base / dev
        link = d / "device"
        if (link / "physfn").exists():
            continue  # an SR-IOV virtual function: its physical port is listed already
        real = os.path.realpath(link) if link.exists() else None
        chain = chain_of(real) if real else None
        bdf = os.path.basename(real) if real else None
        numa = _numa(_read_int(link / "numa_node"))
        try:
            ports = sorted(os.listdir(d / "ports"), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            ports = []
        for port in ports:
            pdir = d / "ports" / port
            rate = _parse_rate(_read(pdir / "rate"))
            state = (_read(pdir / "state") or "").upper()
            active = "ACTIVE" in state
            classes = {g["bus"]: path_class(chain, g.get("chain"), numa, g.get("numa_node")) for g in gpus}
            known = [c for c in classes.values() if c is not None]
            best = min(known, key=PCIE_PATHS.index) if known else None
            nearest = [] if best in (None, "SYS") else [g["bus"] for g in sorted(gpus, key=lambda g: g["index"]) if classes[g["bus"]] == best]
            nics.append(
                {
                    "name": dev,
                    "port": int(port) if port.isdigit() else None,
                    "pci_bus_id": normalize_bus_id(bdf) if bdf and _SYSFS_BDF.match(bdf) else None,
                    "link_layer": _read(pdir / "link_layer"),
                    "rate_gbit_per_s": (rate or 0.0) if active else 0.0,
                    "numa_node": numa,
                    "nearest_gpus": nearest,
                    "path_to_nearest": best if nearest else None,
                }
            )
    return nics


def probe_cpu(root: Path) -> dict:
    """Model, sockets, logical CPUs and the cpulist of every NUMA node."""
    cpuinfo = _read(root / "proc" / "cpuinfo") or ""
    model, packages = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key == "physical id":
            packages.add(value.strip())
    online = _read(root / "sys" / "devices" / "system" / "cpu" / "online")
    logical = len(parse_cpulist(online)) if online else (os.cpu_count() if str(root) == "/" else None)
    numa = {}
    node_dir = root / "sys" / "devices" / "system" / "node"
    try:
        names = os.listdir(node_dir)
    except OSError:
        names = []
    for name in sorted(names):
        m = re.fullmatch(r"node(\d+)", name)
        cpulist = _read(node_dir / name / "cpulist") if m else None
        if m and cpulist:
            numa[m.group(1)] = format_cpulist(parse_cpulist(cpulist))
    return {
        "model": model,
        "sockets": len(packages) or None,
        "logical_cpus": logical or None,
        "numa_nodes": dict(sorted(numa.items(), key=lambda kv: int(kv[0]))) or None,
    }


def _cpu_words(root: Path) -> int:
    possible = _read(root / "sys" / "devices" / "system" / "cpu" / "possible")
    count = (max(parse_cpulist(possible)) + 1) if possible else (os.cpu_count() or 64)
    return max(1, math.ceil(count / 64))


# -- CUDA's view: CUDA_DEVICE_ORDER and CUDA_VISIBLE_DEVICES ---------------------------------------


def cuda_visible(devices: list[dict], env) -> list[dict]:
    """The devices CUDA shows, in CUDA's order: `devices` are in PCI order (NVML's) with `bus`,
    `uuid` and `cc`. CUDA_DEVICE_ORDER=PCI_BUS_ID keeps PCI order; FASTEST_FIRST (CUDA's default)
    puts higher compute capability first, PCI order among equals. CUDA_VISIBLE_DEVICES then picks
    by index in that order or by UUID (`GPU-...`, a unique prefix is enough); a negative index ends
    the list, as in CUDA (`-1` hides every GPU)."""
    order = env.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST"
    if order not in ("FASTEST_FIRST", "PCI_BUS_ID"):
        raise AotError(f"CUDA_DEVICE_ORDER={order!r}: must be FASTEST_FIRST or PCI_BUS_ID")
    ordered = list(devices)
    if order == "FASTEST_FIRST":
        ordered.sort(key=lambda d: tuple(-x for x in (d.get("cc") or (0, 0))))
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return ordered
    if not cvd.strip():
        return []
    n = len(ordered)
    have = f"this machine has {n} GPU{'s' if n != 1 else ''}" + (f": indices 0-{n - 1} or GPU-<uuid>" if n else "")
    chosen: list[dict] = []
    for entry in (e.strip() for e in cvd.split(",")):
        if re.fullmatch(r"[+-]?\d+", entry):
            i = int(entry)
            if i < 0:
                break
            if i >= n:
                raise AotError(f"CUDA_VISIBLE_DEVICES={cvd}: entry {entry!r} names no GPU ({have})")
            dev = ordered[i]
        elif entry.upper().startswith("MIG-"):
            raise AotError(
                f"CUDA_VISIBLE_DEVICES={cvd}: entry {entry!r} is a MIG instance; topology profiles describe whole GPUs (name the GPU by index or GPU-<uuid>)"
            )
        elif entry.upper().startswith("GPU-") and len(entry) > 4:
            found = [d for d in ordered if d["uuid"].upper().startswith(entry.upper())]
            if not found:
                raise AotError(f"CUDA_VISIBLE_DEVICES={cvd}: entry {entry!r} names no GPU ({have})")
            if len(found) > 1:
                raise AotError(
                    f"CUDA_VISIBLE_DEVICES={cvd}: entry {entry!r} matches {len(found)} GPUs ({', '.join(d['uuid'] for d in found)}); give more of the UUID"
                )
            dev = found[0]
        else:
            raise AotError(f"CUDA_VISIBLE_DEVICES={cvd}: entry {entry!r} names no GPU (entries are indices or GPU-<uuid>; {have})")
        if any(d is dev for d in chosen):
            raise AotError(f"CUDA_VISIBLE_DEVICES={cvd}: entry {entry!r} names GPU {dev['bus']} a second time")
        chosen.append(dev)
    return chosen


# -- GPUs -------------------------------------------------------------------------------------


def _nvml_devices(nvml, root: Path, notes: list[str]) -> list[dict]:
    """Every GPU NVML sees, in NVML (PCI) order, with what can be read of each."""
    words = _cpu_words(root)
    scope_node = _const(nvml, "NVML_AFFINITY_SCOPE_NODE", 0)
    devices = []
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            bus = normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(h).busId))
            uuid = _text(nvml.nvmlDeviceGetUUID(h))
            name = _text(nvml.nvmlDeviceGetName(h))
            memory = int(nvml.nvmlDeviceGetMemoryInfo(h).total)
        except Exception as e:
            if isinstance(e, nvml.NVMLError):
                notes.append(f"NVML device {i} skipped ({e})")
                continue
            raise
        cc = _call(nvml, "nvmlDeviceGetCudaComputeCapability", h)
        cpus = _call(nvml, "nvmlDeviceGetCpuAffinity", h, words)
        mem_nodes = _call(nvml, "nvmlDeviceGetMemoryAffinity", h, 4, scope_node)
        nodes = sorted(_bits(mem_nodes)) if mem_nodes is not None else []
        numa = nodes[0] if len(nodes) == 1 else _numa(_read_int(root / "sys" / "bus" / "pci" / "devices" / sysfs_bus_id(bus) / "numa_node"))
        cpu_set = _bits(cpus) if cpus is not None else set()
        if not cpu_set:
            text = _read(root / "sys" / "bus" / "pci" / "devices" / sysfs_bus_id(bus) / "local_cpulist")
            cpu_set = parse_cpulist(text) if text else set()
        gen = _call(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h)
        width = _call(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h)
        known = KNOWN_GPUS.get(name, {})
        bandwidth = known.get("memory_bandwidth_gb_per_s")
        if bandwidth is None:
            bits = _call(nvml, "nvmlDeviceGetMemoryBusWidth", h)
            clock = _call(nvml, "nvmlDeviceGetMaxClockInfo", h, _const(nvml, "NVML_CLOCK_MEM", 2))
            bandwidth = round(bits / 8 * clock * 2 / 1000, 1) if bits and clock else None
        devices.append(
            {
                "handle": h,
                "bus": bus,
                "uuid": uuid,
                "name": name,
                "cc": tuple(cc) if cc and cc[0] > 0 else None,
                "memory_bytes": memory,
                "memory_bandwidth_gb_per_s": bandwidth,
                "peak_tflops": dict(known.get("peak_tflops", {})),
                "numa_node": numa,
                "cpu_affinity": format_cpulist(cpu_set) if cpu_set else None,
                "pcie": {"generation": int(gen), "width": int(width)} if gen and width else None,
            }
        )
    return devices


def _nvlinks(nvml, handle, gpu_buses: set[str]) -> list[tuple[int, str | None]]:
    """(remote device type, remote bus id) of every active NVLink of one GPU."""
    out = []
    enabled = _const(nvml, "NVML_FEATURE_ENABLED", 1)
    for link in range(_const(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _call(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state != enabled:
            continue
        remote = _call(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        try:
            rbus = normalize_bus_id(_text(remote.busId)) if remote is not None else None
        except AotError:
            rbus = None
        rtype = _call(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        if rtype is None:  # older drivers: a remote that is not one of our GPUs is a switch
            rtype = _GPU if rbus in gpu_buses else _SWITCH
        out.append((rtype, rbus))
    return out


def _pairs(nvml, visible: list[dict], all_buses: set[str]) -> tuple[list[dict], int]:
    links = {d["bus"]: _nvlinks(nvml, d["handle"], all_buses) for d in visible}
    switches = {rbus for ls in links.values() for t, rbus in ls if t == _SWITCH and rbus}
    ok = _const(nvml, "NVML_P2P_STATUS_OK", 0)
    read, write = _const(nvml, "NVML_P2P_CAPS_INDEX_READ", 0), _const(nvml, "NVML_P2P_CAPS_INDEX_WRITE", 1)
    out = []
    for ai, a in enumerate(visible):
        for b in visible[ai + 1 :]:
            direct = sum(1 for t, rbus in links[a["bus"]] if t == _GPU and rbus == b["bus"])
            sa = sum(1 for t, _ in links[a["bus"]] if t == _SWITCH)
            sb = sum(1 for t, _ in links[b["bus"]] if t == _SWITCH)
            via_switch = min(sa, sb)
            count = direct + via_switch
            nvlink = None
            if count:
                rates = [NVLINK_GB_PER_S.get(d["cc"]) for d in (a, b)]
                known_rates = [r for r in rates if r is not None]
                rate = min(known_rates) if len(known_rates) == len(rates) else None
                nvlink = {"count": count, "gb_per_s_per_direction": round(count * rate, 3) if rate else None, "via": "nvswitch" if via_switch else "direct"}
            level = _call(nvml, "nvmlDeviceGetTopologyCommonAncestor", a["handle"], b["handle"])
            statuses = [_call(nvml, "nvmlDeviceGetP2PStatus", a["handle"], b["handle"], cap) for cap in (read, write)]
            p2p = None if None in statuses else all(s == ok for s in statuses)
            out.append({"gpus": [a["bus"], b["bus"]], "nvlink": nvlink, "pcie_path": _ANCESTOR.get(level) if level is not None else None, "p2p": p2p})
    return out, len(switches)


def _torch_devices(notes: list[str]) -> list[dict]:
    """Without NVML: what the CUDA runtime says (no links, affinity or NICs)."""
    import torch

    if not torch.cuda.is_available():
        return []
    notes.append("NVML unavailable: GPUs read through the CUDA runtime; links, PCIe paths, NUMA and CPU affinity unknown")
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = None
        if hasattr(p, "pci_bus_id"):
            bus = f"{getattr(p, 'pci_domain_id', 0):08X}:{p.pci_bus_id:02X}:{getattr(p, 'pci_device_id', 0):02X}.0"
        known = KNOWN_GPUS.get(p.name, {})
        devices.append(
            {
                "handle": None,
                "bus": bus or f"{0xFFFF:08X}:{i:02X}:00.0",
                "uuid": str(getattr(p, "uuid", "")),
                "name": p.name,
                "cc": (p.major, p.minor),
                "memory_bytes": int(p.total_memory),
                "memory_bandwidth_gb_per_s": known.get("memory_bandwidth_gb_per_s"),
                "peak_tflops": dict(known.get("peak_tflops", {})),
                "numa_node": None,
                "cpu_affinity": None,
                "pcie": None,
            }
        )
    return devices


def _torch_may_have_cuda(root: Path) -> bool:
    return "torch" in sys.modules or (root / "dev" / "nvidiactl").exists()


# -- the profile ------------------------------------------------------------------------------


def probe(*, nvml=None, env=None, root: str | Path = "/", nodes: int = 1, name: str | None = None, torch_fallback: bool | None = None) -> dict:
    """This machine as a validated topology profile (see the module docstring). `nvml` is the
    pynvml module to use (default: the installed one); `root` prefixes /sys and /proc."""
    env = os.environ if env is None else env
    root = Path(root)
    injected = nvml is not None
    nvml = nvml if injected else import_nvml()
    torch_fallback = (not injected) if torch_fallback is None else torch_fallback
    notes: list[str] = []
    source, driver = "none", None
    visible: list[dict] = []
    links: list[dict] = []
    nvswitches = 0
    started = False
    if nvml is not None:
        try:
            nvml.nvmlInit()
            started = True
        except Exception as e:
            if not isinstance(e, getattr(nvml, "NVMLError", ())):
                raise
            notes.append(f"NVML unavailable ({e})")
    else:
        notes.append("NVML unavailable (nvidia-ml-py is not installed)")
    if started:
        try:
            source = "nvml"
            driver = _call(nvml, "nvmlSystemGetDriverVersion")
            driver = _text(driver) if driver is not None else None
            devices = _nvml_devices(nvml, root, notes)
            visible = cuda_visible(devices, env)
            links, nvswitches = _pairs(nvml, visible, {d["bus"] for d in devices})
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
    elif torch_fallback and _torch_may_have_cuda(root):
        visible = _torch_devices(notes)
        source = "torch" if visible else "none"

    gpus = {}
    for index, d in enumerate(visible):
        d["index"] = index
        d["chain"] = pci_chain(root, sysfs_bus_id(d["bus"])) if source == "nvml" else None
        gpus[d["bus"]] = {
            "index": index,
            "uuid": d["uuid"] or None,
            "name": d["name"],
            "compute_capability": list(d["cc"]) if d["cc"] else None,
            "memory_bytes": d["memory_bytes"],
            "memory_bandwidth_gb_per_s": d["memory_bandwidth_gb_per_s"],
            "peak_tflops": d["peak_tflops"],
            "numa_node": d["numa_node"],
            "cpu_affinity": d["cpu_affinity"],
            "pcie": d["pcie"],
        }
    nics = probe_nics(root, visible)
    kind = "cuda" if gpus else "cpu"
    rails = [n for n in nics if n["nearest_gpus"] and n["rate_gbit_per_s"] > 0]
    fabric = None
    if kind == "cuda" and rails:
        layers = {(n.get("link_layer") or "").lower() for n in rails}
        fabric = {
            "kind": "infiniband" if layers == {"infiniband"} else "roce",
            "rails_per_node": len(rails),
            "gb_per_s_per_rail": min(n["rate_gbit_per_s"] for n in rails) / 8,
            "latency_us": None,
        }
    host = socket.gethostname()
    profile = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "name": name or host,
        "description": "",
        "device_kind": kind,
        "backend": BACKENDS[kind],
        "nodes": nodes,
        "node": {
            "cpu": probe_cpu(root),
            "gpus": gpus,
            "links": links,
            "nvswitches": nvswitches,
            "nics": nics,
        },
        "fabric": fabric,
        "probe": {
            "source": source,
            "hostname": host,
            "driver_version": driver,
            "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
            "cuda_device_order": env.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST",
            "notes": notes,
        },
    }
    if kind == "cpu":
        profile["description"] = f"CPU-only machine {host}: ranks are processes talking gloo"
    else:
        profile["description"] = f"probed on {host}: {describe(profile)}"
    validate_profile(profile, "the probe of this machine")
    return profile


# -- the live machine -------------------------------------------------------------------------


def live_profile(*, nvml=None, env=None, root: str | Path = "/") -> dict:
    """This machine as a profile: the NVML probe (runner.hardware.nvml_probe) honouring CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER, with `nodes` from torchrun's environment. A machine without GPUs (or without
    NVML and CUDA) is the built-in `cpu` profile."""
    env = os.environ if env is None else env
    nodes = job_nodes(env)
    profile = probe(nvml=nvml, env=env, root=root, nodes=nodes or 1, name="live")
    if profile["device_kind"] == "cpu":
        profile = {**load_profile("cpu"), "nodes": nodes or 1}
    if nodes is None:
        profile["nodes_unknown"] = True  # a launcher that does not say: the node count is not checked
    return profile
