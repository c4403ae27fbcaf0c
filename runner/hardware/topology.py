"""Topology profiles: the hardware an artifact was built for, as a checked contract.

A profile is JSON (schema "aot-topology", version 2; docs/topology.md is its specification):
node count and, for the node type, GPUs keyed by PCI bus id, GPU-pair links (NVLink, PCIe path
class, P2P), NICs, the inter-node fabric and optional measured alpha/beta per link class. Built-in
profiles ship in runner/hardware/profiles/ and are named by file stem; any other profile is a JSON file, or
an artifact folder whose embedded profile is reused.

The runner compares the live machine (runner.hardware.nvml_probe's `live_profile()`, read through NVML)
with the profile embedded in the artifact before its first collective (`verify_live`). Nothing
here imports torch at module level: `aot topology show` stays instant.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import NoReturn, TypeGuard

from runner.errors import AotError
from runner.format.integrity import canonical_json, sha256_bytes
from runner.hardware.sysfs import BUS_ID, CPULIST, normalize_bus_id

SCHEMA = "aot-topology"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 (node.gpus a list, no links) is read for artifacts built with it
BUILTIN_DIR = Path(__file__).parent / "profiles"
DEVICE_KINDS = ("cpu", "cuda")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # nearest first, as `nvidia-smi topo -m`
NVLINK_VIA = ("nvswitch", "direct")
LINK_CLASSES = ("nvlink", "pcie", "network", "loopback")
DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
FABRIC_KINDS = ("infiniband", "roce", "ethernet", "loopback")

# What legitimately varies between two machines of one model.
MEMORY_TOLERANCE = 0.02  # NVML vs CUDA runtime totals, ECC and driver reservations: ~1% on 80 GB parts
MAX_LISTED = 8  # pairs or NICs named per mismatch line before "and N more"


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def dumps_profile(profile: dict, width: int = 160) -> str:
    """The profile as JSON for people: nested, but objects and lists that fit on a line stay on one."""

    def fmt(value, indent: int) -> str:
        flat = json.dumps(value)
        if not isinstance(value, (dict, list)) or (indent >= 2 and len(flat) + indent <= width):
            return flat
        pad, inner = " " * indent, " " * (indent + 1)
        if isinstance(value, dict):
            items = [f"{inner}{json.dumps(k)}: {fmt(v, indent + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}" if items else "{}"
        items = [f"{inner}{fmt(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]" if items else "[]"

    return fmt(profile, 0) + "\n"


# -- loading and validation -------------------------------------------------------------------


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> dict:
    """A validated profile from a built-in name, a JSON file, or an artifact folder (its embedded profile)."""
    path = Path(name_or_path)
    if not path.suffix and "/" not in str(name_or_path) and (BUILTIN_DIR / f"{name_or_path}.json").is_file():
        path = BUILTIN_DIR / f"{name_or_path}.json"
    elif path.is_dir() and (path / "manifest.json").is_file():
        return _profile_of_artifact(path)
    elif not path.is_file():
        raise AotError(f"topology {name_or_path!r}: no such file and no built-in profile of that name (built-in: {', '.join(builtin_names())})")
    try:
        profile = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AotError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise AotError(f"{path}: cannot read ({e.strerror})") from None
    validate_profile(profile, str(path))
    return normalize_profile(profile)


def _profile_of_artifact(folder: Path) -> dict:
    where = f"{folder}/manifest.json"
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        topo = manifest["topology"]
        profile = topo["profile"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        raise AotError(f"{where}: not an artifact manifest with an embedded topology profile") from None
    validate_profile(profile, f"{where} (topology.profile)")
    if topo.get("sha256") != profile_sha256(profile):
        raise AotError(f"{where}: the embedded topology profile does not match its sha256 (manifest altered)")
    return profile


def profile_sha256(profile: dict) -> str:
    return sha256_bytes(canonical_json(profile))


class _Checker:
    """Field checks that fail with one line naming the file and the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, what: str, value=None, show=True) -> NoReturn:
        got = f" (got {json.dumps(value)})" if show else ""
        raise AotError(f"{self.where}: field '{field}' {what}{got}")

    def get(self, obj: dict, key: str, field: str, optional=False):
        if key not in obj:
            if optional:
                return None
            raise AotError(f"{self.where}: field '{field}' is missing")
        return obj[key]

    @staticmethod
    def _is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    @staticmethod
    def _is_num(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def int_(self, v, field, lo=None, hi=None, null=False):
        if v is None and null:
            return
        if not self._is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = (f" in {lo}..{hi}" if hi is not None else f" >= {lo}") if lo is not None else ""
            self.fail(field, f"must be an integer{rng}" + (" or null" if null else ""), v)

    def num(self, v, field, lo=0.0, strict=True, null=False):
        if v is None and null:
            return
        if not self._is_num(v) or (v <= lo if strict else v < lo):
            self.fail(field, f"must be a number {'>' if strict else '>='} {lo:g}" + (" or null" if null else ""), v)

    def str_(self, v, field, null=False, choices=None):
        if v is None and null:
            return
        if not isinstance(v, str) or not v.strip():
            self.fail(field, "must be a non-empty string" + (" or null" if null else ""), v)
        if choices is not None and v not in choices:
            self.fail(field, f"must be one of {', '.join(choices)}" + (" or null" if null else ""), v)

    def bool_(self, v, field, null=False):
        if v is None and null:
            return
        if not isinstance(v, bool):
            self.fail(field, "must be true or false" + (" or null" if null else ""), v)

    def dict_(self, v, field, null=False) -> TypeGuard[dict]:
        if v is None and null:
            return False
        if not isinstance(v, dict):
            self.fail(field, "must be an object" + (" or null" if null else ""), v, show=not isinstance(v, (list, dict)))
        return True

    def list_(self, v, field):
        if not isinstance(v, list):
            self.fail(field, "must be a list", v, show=not isinstance(v, dict))

    def bus(self, v, field) -> str:
        if not isinstance(v, str) or not BUS_ID.match(v.strip()):
            self.fail(field, "must be a PCI bus id such as 00000000:07:00.0", v)
        return normalize_bus_id(v)

    def cpulist(self, v, field, null=True):
        if v is None and null:
            return
        if not isinstance(v, str) or not CPULIST.match(v):
            self.fail(field, 'must be a cpulist such as "0-15,128-143"' + (" or null" if null else ""), v)


def validate_profile(profile: dict, where: str) -> None:
    """Raise AotError naming `where` and the field if `profile` is not a readable topology profile."""
    if not isinstance(profile, dict) or profile.get("schema") != SCHEMA:
        raise AotError(f"{where}: not a topology profile (field 'schema' must be {SCHEMA!r})")
    version = profile.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise AotError(
            f"{where}: topology schema version {version!r}; this aot reads versions {', '.join(map(str, READABLE_VERSIONS))} and writes {SCHEMA_VERSION}"
        )
    c = _Checker(where)
    c.str_(c.get(profile, "name", "name"), "name")
    kind = c.get(profile, "device_kind", "device_kind")
    c.str_(kind, "device_kind", choices=DEVICE_KINDS)
    nodes = c.get(profile, "nodes", "nodes")
    if not c._is_int(nodes) or nodes < 1:
        raise AotError(f"{where}: field 'nodes' must be a positive integer (got {json.dumps(nodes)})")
    node = c.get(profile, "node", "node")
    c.dict_(node, "node")
    if version == 1:
        if not isinstance(node.get("gpus"), list):
            raise AotError(f"{where}: field 'node.gpus' must be a list")
        return
    backend = c.get(profile, "backend", "backend")
    c.str_(backend, "backend", choices=tuple(sorted(set(BACKENDS.values()))))
    if backend != BACKENDS[kind]:
        c.fail("backend", f"must be {BACKENDS[kind]!r} for device_kind {kind!r}", backend)
    if profile.get("description") is not None and not isinstance(profile["description"], str):
        c.fail("description", "must be a string", profile["description"])

    gpus = c.get(node, "gpus", "node.gpus")
    c.dict_(gpus, "node.gpus")
    if kind == "cuda" and not gpus:
        c.fail("node.gpus", "must list at least one GPU for device_kind 'cuda'", gpus, show=False)
    if kind == "cpu" and gpus:
        c.fail("node.gpus", "must be empty for device_kind 'cpu'", None, show=False)
    buses = set()
    indices = []
    for key, gpu in gpus.items():
        f = f"node.gpus.{key}"
        if not BUS_ID.match(key.strip()):
            raise AotError(f"{where}: key {key!r} of field 'node.gpus' must be a PCI bus id such as 00000000:07:00.0")
        bus = normalize_bus_id(key)
        if bus in buses:
            c.fail(f, "names a GPU already listed (bus ids are case-insensitive)", key)
        buses.add(bus)
        c.dict_(gpu, f)
        index = c.get(gpu, "index", f"{f}.index")
        c.int_(index, f"{f}.index", lo=0)
        indices.append(index)
        c.str_(c.get(gpu, "name", f"{f}.name"), f"{f}.name")
        cc = c.get(gpu, "compute_capability", f"{f}.compute_capability")
        if cc is not None and not (isinstance(cc, list) and len(cc) == 2 and all(c._is_int(x) for x in cc) and 1 <= cc[0] <= 99 and 0 <= cc[1] <= 99):
            c.fail(f"{f}.compute_capability", "must be [major, minor], e.g. [8, 0], or null", cc)
        c.int_(c.get(gpu, "memory_bytes", f"{f}.memory_bytes"), f"{f}.memory_bytes", lo=1)
        c.num(gpu.get("memory_bandwidth_gb_per_s"), f"{f}.memory_bandwidth_gb_per_s", null=True)
        tflops = gpu.get("peak_tflops", {})
        if c.dict_(tflops, f"{f}.peak_tflops", null=True):
            for dtype, value in tflops.items():
                if dtype not in DTYPES:
                    c.fail(f"{f}.peak_tflops", f"has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})", None, show=False)
                c.num(value, f"{f}.peak_tflops.{dtype}")
        c.int_(gpu.get("numa_node"), f"{f}.numa_node", lo=0, hi=4095, null=True)
        c.cpulist(gpu.get("cpu_affinity"), f"{f}.cpu_affinity")
        pcie = gpu.get("pcie")
        if c.dict_(pcie, f"{f}.pcie", null=True):
            c.int_(c.get(pcie, "generation", f"{f}.pcie.generation"), f"{f}.pcie.generation", lo=1, hi=7)
            width = c.get(pcie, "width", f"{f}.pcie.width")
            if width not in (1, 2, 4, 8, 16, 32) or isinstance(width, bool):
                c.fail(f"{f}.pcie.width", "must be one of 1, 2, 4, 8, 16, 32", width)
        if "uuid" in gpu:
            c.str_(gpu["uuid"], f"{f}.uuid", null=True)
    if sorted(indices) != list(range(len(indices))):
        c.fail("node.gpus", f"indices must be 0..{len(indices) - 1}, each once", sorted(indices))

    links = node.get("links", [])
    c.list_(links, "node.links")
    seen = set()
    for i, link in enumerate(links):
        f = f"node.links[{i}]"
        c.dict_(link, f)
        pair = c.get(link, "gpus", f"{f}.gpus")
        if not (isinstance(pair, list) and len(pair) == 2):
            c.fail(f"{f}.gpus", "must be a list of two GPU bus ids", pair)
        a, b = (c.bus(x, f"{f}.gpus") for x in pair)
        for x in (a, b):
            if x not in buses:
                c.fail(f"{f}.gpus", "names a GPU not in node.gpus", x)
        if a == b:
            c.fail(f"{f}.gpus", "must name two different GPUs", pair)
        key = frozenset((a, b))
        if key in seen:
            c.fail(f"{f}.gpus", "repeats a GPU pair already listed", pair)
        seen.add(key)
        nv = link.get("nvlink")
        if c.dict_(nv, f"{f}.nvlink", null=True):
            c.int_(c.get(nv, "count", f"{f}.nvlink.count"), f"{f}.nvlink.count", lo=1, hi=72)
            c.num(nv.get("gb_per_s_per_direction"), f"{f}.nvlink.gb_per_s_per_direction", null=True)
            c.str_(c.get(nv, "via", f"{f}.nvlink.via"), f"{f}.nvlink.via", choices=NVLINK_VIA)
        c.str_(link.get("pcie_path"), f"{f}.pcie_path", null=True, choices=PCIE_PATHS)
        c.bool_(link.get("p2p"), f"{f}.p2p", null=True)
    if "nvswitches" in node:
        c.int_(node["nvswitches"], "node.nvswitches", lo=0, null=True)
    if "nvls" in node:
        c.bool_(node["nvls"], "node.nvls", null=True)

    nics = node.get("nics", [])
    c.list_(nics, "node.nics")
    for i, nic in enumerate(nics):
        f = f"node.nics[{i}]"
        c.dict_(nic, f)
        c.str_(c.get(nic, "name", f"{f}.name"), f"{f}.name")
        c.num(c.get(nic, "rate_gbit_per_s", f"{f}.rate_gbit_per_s"), f"{f}.rate_gbit_per_s", strict=False)
        c.int_(nic.get("numa_node"), f"{f}.numa_node", lo=0, hi=4095, null=True)
        near = nic.get("nearest_gpus", [])
        c.list_(near, f"{f}.nearest_gpus")
        for x in near:
            if c.bus(x, f"{f}.nearest_gpus") not in buses:
                c.fail(f"{f}.nearest_gpus", "names a GPU not in node.gpus", x)
        c.str_(nic.get("path_to_nearest"), f"{f}.path_to_nearest", null=True, choices=PCIE_PATHS)
        if nic.get("pci_bus_id") is not None:
            c.bus(nic["pci_bus_id"], f"{f}.pci_bus_id")
        if "port" in nic:
            c.int_(nic["port"], f"{f}.port", lo=1, null=True)
        if "link_layer" in nic:
            c.str_(nic["link_layer"], f"{f}.link_layer", null=True)

    cpu = node.get("cpu")
    if c.dict_(cpu, "node.cpu", null=True):
        c.str_(cpu.get("model"), "node.cpu.model", null=True)
        c.int_(cpu.get("sockets"), "node.cpu.sockets", lo=1, null=True)
        c.int_(cpu.get("logical_cpus"), "node.cpu.logical_cpus", lo=1, null=True)
        numa = cpu.get("numa_nodes")
        if c.dict_(numa, "node.cpu.numa_nodes", null=True):
            for k, v in numa.items():
                if not k.isdigit():
                    c.fail("node.cpu.numa_nodes", "keys must be NUMA node numbers", k)
                c.cpulist(v, f"node.cpu.numa_nodes.{k}", null=False)

    fabric = profile.get("fabric")
    if c.dict_(fabric, "fabric", null=True):
        c.str_(c.get(fabric, "kind", "fabric.kind"), "fabric.kind", choices=FABRIC_KINDS)
        c.int_(c.get(fabric, "rails_per_node", "fabric.rails_per_node"), "fabric.rails_per_node", lo=0, hi=64)
        c.num(fabric.get("gb_per_s_per_rail"), "fabric.gb_per_s_per_rail", null=True)
        c.num(fabric.get("latency_us"), "fabric.latency_us", null=True)

    calibration = profile.get("calibration")
    if c.dict_(calibration, "calibration", null=True):
        for cls, ab in calibration.items():
            f = f"calibration.{cls}"
            if cls not in LINK_CLASSES:
                c.fail("calibration", f"has unknown link class {cls!r} (known: {', '.join(LINK_CLASSES)})", None, show=False)
            c.dict_(ab, f)
            c.num(c.get(ab, "alpha_s", f"{f}.alpha_s"), f"{f}.alpha_s", strict=False)
            c.num(c.get(ab, "beta_s_per_byte", f"{f}.beta_s_per_byte"), f"{f}.beta_s_per_byte", strict=False)


def normalize_profile(profile: dict) -> dict:
    """A copy with every PCI bus id spelled as NVML does (keys, link ends, NIC locality)."""
    if profile.get("schema_version") != SCHEMA_VERSION:
        return profile
    p = copy.deepcopy(profile)
    node = p["node"]
    node["gpus"] = {normalize_bus_id(k): v for k, v in node["gpus"].items()}
    for link in node.get("links", []):
        link["gpus"] = [normalize_bus_id(x) for x in link["gpus"]]
    for nic in node.get("nics", []):
        nic["nearest_gpus"] = [normalize_bus_id(x) for x in nic.get("nearest_gpus", [])]
        if nic.get("pci_bus_id"):
            nic["pci_bus_id"] = normalize_bus_id(nic["pci_bus_id"])
    return p


# -- reading a profile ------------------------------------------------------------------------


def every_rank(profile: dict) -> int:
    """Ranks of a job over every node of `profile` (for_nodes'): one per GPU, one per node of a cpu profile."""
    return profile["nodes"] * (len(gpus_in_order(profile)) if profile["device_kind"] == "cuda" else 1)


def gpus_in_order(profile: dict) -> list[tuple[str | None, dict]]:
    """(bus id, GPU) in CUDA device order (the profile's `index`); version-1 lists have no bus ids."""
    gpus = profile.get("node", {}).get("gpus", {})
    if isinstance(gpus, list):
        return [(None, g) for g in sorted(gpus, key=lambda g: g.get("index", 0))]
    return sorted(gpus.items(), key=lambda kv: kv[1]["index"])


def pair_links(profile: dict) -> dict[tuple[int, int], dict]:
    """(i, j) with i < j GPU indices -> the link entry of that pair."""
    gpus = profile.get("node", {}).get("gpus", {})
    if isinstance(gpus, list):
        return {}
    index = {bus: g["index"] for bus, g in gpus.items()}
    out = {}
    for link in profile["node"].get("links", []):
        i, j = sorted(index[normalize_bus_id(b)] for b in link["gpus"])
        out[(i, j)] = link
    return out


def nic_list(profile: dict) -> list[dict]:
    node = profile.get("node", {})
    return node.get("nics", []) if isinstance(node.get("gpus"), dict) else []


def gpu_label(indices) -> str:
    """[0, 1, 2, 5] -> `GPU0-GPU2,GPU5`."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"GPU{run[0]}-GPU{run[-1]}" if len(run) > 2 else ",".join(f"GPU{x}" for x in run))
        run = [i]
    if run:
        out.append(f"GPU{run[0]}-GPU{run[-1]}" if len(run) > 2 else ",".join(f"GPU{x}" for x in run))
    return ",".join(out) if out else "no GPU"


def nvlink_label(link: dict | None) -> str:
    nv = (link or {}).get("nvlink")
    return f"NV{nv['count']}" if nv else "no NVLink"


def describe(profile: dict) -> str:
    """One line: `1 node x 8 NVIDIA A100-SXM4-80GB, NV12 all pairs via 6 NVSwitches, 8x 200 Gb/s NICs`."""
    nodes = profile["nodes"]
    head = f"{nodes} node{'s' if nodes != 1 else ''}"
    if profile["device_kind"] == "cpu":
        return f"{head}, CPU only (ranks are processes, {profile.get('backend', 'gloo')})"
    gpus = gpus_in_order(profile)
    names = sorted({g["name"] for _, g in gpus})
    parts = [f"{head} x {len(gpus)} {' + '.join(names)}"]
    links = pair_links(profile)
    counts = {(l.get("nvlink") or {}).get("count") for l in links.values()}
    n_pairs = len(gpus) * (len(gpus) - 1) // 2
    if links and len(counts) == 1 and None not in counts and len(links) == n_pairs:
        nvs = profile["node"].get("nvswitches")
        parts.append(f"NV{counts.pop()} all pairs" + (f" via {nvs} NVSwitches" if nvs else ""))
    elif any(l.get("nvlink") for l in links.values()):
        parts.append(f"NVLink on {sum(1 for l in links.values() if l.get('nvlink'))} of {n_pairs} pairs")
    elif links:
        parts.append("no NVLink")
    nics = [n for n in nic_list(profile) if n.get("rate_gbit_per_s")]
    if nics:
        rates = sorted({n["rate_gbit_per_s"] for n in nics}, reverse=True)
        parts.append(f"{len(nics)}x {'/'.join(f'{r:g}' for r in rates)} Gb/s NICs")
    return ", ".join(parts)


# -- multi-node -------------------------------------------------------------------------------


def for_nodes(profile: dict, nodes: int | None, world_size: int | None = None) -> dict:
    """`profile` for a job of `nodes` nodes (None: the profile's own count), checked against the world size."""
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise AotError(f"--nodes must be at least 1, got {nodes}")
        if nodes != profile["nodes"]:
            profile = {**profile, "nodes": nodes}
    n = profile["nodes"]
    if world_size is not None:
        if world_size < n:
            raise AotError(f"world size {world_size} is fewer ranks than the {n} nodes of topology {profile['name']!r}")
        if world_size % n:
            raise AotError(f"world size {world_size} does not split evenly over the {n} nodes of topology {profile['name']!r}")
        per_node = world_size // n
        gpus = len(gpus_in_order(profile))
        if profile["device_kind"] == "cuda" and per_node > gpus:
            hint = math.ceil(world_size / gpus)
            raise AotError(
                f"world size {world_size} on {n} node(s) is {per_node} ranks per node, but topology "
                f"{profile['name']!r} has {gpus} GPU(s) per node (one rank per GPU): use --nodes {hint}, "
                f"or --topology for the machines the artifact will run on"
            )
    return profile


def job_nodes(env=None) -> int | None:
    """Nodes of the running job: torchrun's GROUP_WORLD_SIZE, else WORLD_SIZE / LOCAL_WORLD_SIZE, else
    Slurm's node count for a multi-process launch; 1 outside any launcher; None when a multi-process
    launch does not say."""
    env = os.environ if env is None else env
    try:
        if env.get("GROUP_WORLD_SIZE"):
            return max(1, int(env["GROUP_WORLD_SIZE"]))
        if env.get("WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
            return max(1, math.ceil(int(env["WORLD_SIZE"]) / int(env["LOCAL_WORLD_SIZE"])))
        if int(env.get("WORLD_SIZE") or 1) > 1:
            slurm = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
            return max(1, int(slurm)) if slurm else None
    except ValueError:
        return None
    return 1
