"""Comparing the live machine with an artifact's topology profile: one line per mismatch class.

The runner calls `verify_live` on every node before its first collective; `aot topology verify`
prints the same lines. Split from runner.hardware.topology, which owns the profile schema and loading.
"""

from __future__ import annotations

import os

from runner.errors import AotError
from runner.hardware.node_refusal import NodeRefusal
from runner.hardware.nvml_probe import live_profile
from runner.hardware.sysfs import normalize_bus_id
from runner.hardware.topology import (
    MAX_LISTED,
    MEMORY_TOLERANCE,
    gpu_label,
    gpus_in_order,
    mib,
    nic_list,
    nvlink_label,
    pair_links,
    validate_profile,
)


def _grouped(items: list[tuple[str, str, str]], template: str, limit: int = MAX_LISTED) -> str:
    """[(who, got, want)] -> `template` per distinct (got, want), its `who` listing every pair involved."""
    groups: dict[tuple[str, str], list[str]] = {}
    for who, got, want in items:
        groups.setdefault((got, want), []).append(who)
    parts = []
    for (got, want), whos in groups.items():
        shown = ", ".join(whos[:limit]) + (f" and {len(whos) - limit} more" if len(whos) > limit else "")
        parts.append(template.format(who=shown, got=got, want=want))
    return "; ".join(parts)


def _gpu_who(indices: list[int], buses: dict[int, str | None]) -> str:
    label = gpu_label(indices)
    named = [bus for bus in (buses.get(i) for i in indices) if bus]
    if len(indices) <= 2 and len(named) == len(indices):
        label += " (" + ", ".join(named) + ")"
    return label


def _per_gpu_line(cls: str, diffs: list[tuple[int, str, str]], buses: dict[int, str | None]) -> str:
    groups: dict[tuple[str, str], list[int]] = {}
    for i, got, want in diffs:
        groups.setdefault((got, want), []).append(i)
    parts = []
    for (got, want), idx in groups.items():
        verb = "is" if len(idx) == 1 else "are"
        parts.append(f"{_gpu_who(idx, buses)} {verb} {got}, profile expects {want}")
    return f"{cls}: " + "; ".join(parts)


def _pcie_text(p: dict | None) -> str:
    return f"Gen{p['generation']} x{p['width']}" if p else "unknown"


def _nic_locality(profile: dict) -> dict[tuple, list[dict]]:
    index = {bus: g["index"] for bus, g in gpus_in_order(profile) if bus}
    groups: dict[tuple, list[dict]] = {}
    for nic in nic_list(profile):
        key = tuple(sorted(index[normalize_bus_id(b)] for b in nic.get("nearest_gpus", []) if normalize_bus_id(b) in index))
        groups.setdefault(key, []).append(nic)
    return groups


def _nic_line(profile: dict, live: dict, visible: int) -> str | None:
    """NICs are matched by locality (the GPU indices they are nearest) and compared by rate; a live
    node may have more NICs than the profile (storage, management). NICs near GPUs this node does
    not show are left to the GPU count line."""
    want_groups = {k: [n for n in v if n["rate_gbit_per_s"] > 0] for k, v in _nic_locality(profile).items()}
    want_groups = {k: v for k, v in want_groups.items() if v}
    if not want_groups:
        return None
    if not nic_list(live):
        total = sum(len(v) for v in want_groups.values())
        rates = "/".join(f"{r:g}" for r in sorted({n["rate_gbit_per_s"] for v in want_groups.values() for n in v}, reverse=True))
        return f"NIC: profile {profile['name']!r} expects {total} NIC{'s' if total != 1 else ''} at {rates} Gb/s; this node has none"
    got_groups = _nic_locality(live)
    problems = []
    for key in sorted(want_groups):
        if any(i >= visible for i in key):
            continue
        want = sorted((n["rate_gbit_per_s"] for n in want_groups[key]), reverse=True)
        got = sorted(got_groups.get(key, []), key=lambda n: -n["rate_gbit_per_s"])
        where = f"near {gpu_label(key)}" if key else "not near a GPU"
        for w, n in zip(want, got):
            if n["rate_gbit_per_s"] < w:
                state = "is down" if n["rate_gbit_per_s"] == 0 else f"runs at {n['rate_gbit_per_s']:g} Gb/s"
                problems.append(f"{n['name']} {where} {state}, profile expects {w:g} Gb/s")
        missing = len(want) - len(got)
        if missing > 0:
            rate = "/".join(f"{r:g}" for r in sorted(set(want[len(got) :]), reverse=True))
            problems.append(f"{missing} of {len(want)} NIC{'s' if len(want) != 1 else ''} at {rate} Gb/s {where} not found")
    if not problems:
        return None
    shown = problems[:MAX_LISTED] + ([f"and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else [])
    return "NIC: " + "; ".join(shown)


def mismatches(profile: dict, live: dict, *, check_nodes: bool = True) -> list[str]:
    """One line per class of difference that makes the artifact's schedule wrong for this machine
    (node count, GPU count, model, memory, NUMA node, PCIe link, NVLink count, PCIe path, P2P,
    NIC), each naming the GPUs involved. GPUs are matched by CUDA device index; bus ids may differ
    between machines of one model. Unknown (null) facts on either side are not compared."""
    validate_profile(profile, f"topology profile {profile.get('name')!r}" if isinstance(profile, dict) else "topology profile")
    name = profile["name"]
    lines = []
    if check_nodes and not live.get("nodes_unknown") and profile["nodes"] != live.get("nodes", 1):
        n = profile["nodes"]
        lines.append(f"node count: profile {name!r} is for {n} node{'s' if n != 1 else ''}; this job runs on {live.get('nodes', 1)}")
    if profile["device_kind"] != "cuda":
        return lines  # CPU profiles run on any machine: ranks are processes
    want = gpus_in_order(profile)
    got = gpus_in_order(live) if live.get("device_kind") == "cuda" else []
    if len(want) != len(got):
        names = " + ".join(sorted({g.get("name", "?") for _, g in want}))
        has = f"{len(got)} visible" if got else "none"
        cvd = live.get("probe", {}).get("cuda_visible_devices")
        lines.append(
            f"GPU count: profile {name!r} expects {len(want)} GPU{'s' if len(want) != 1 else ''} per node ({names}); this node has {has}"
            + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None and got else "")
        )
    n = min(len(want), len(got))
    buses = {i: got[i][0] for i in range(n)}
    model, memory, numa, pcie = [], [], [], []
    for i in range(n):
        w, g = want[i][1], got[i][1]
        if (w.get("name") and g.get("name") and w["name"] != g["name"]) or (
            w.get("compute_capability") and g.get("compute_capability") and list(w["compute_capability"]) != list(g["compute_capability"])
        ):
            model.append((i, repr(g["name"]), repr(w["name"])))
        if w.get("memory_bytes") and g.get("memory_bytes") and abs(g["memory_bytes"] - w["memory_bytes"]) > MEMORY_TOLERANCE * w["memory_bytes"]:
            memory.append((i, mib(g["memory_bytes"]), f"{mib(w['memory_bytes'])} (±{MEMORY_TOLERANCE:.0%})"))
        if w.get("numa_node") is not None and g.get("numa_node") is not None and w["numa_node"] != g["numa_node"]:
            numa.append((i, f"on NUMA node {g['numa_node']}", str(w["numa_node"])))
        wp, gp = w.get("pcie"), g.get("pcie")
        if wp and gp and (wp["generation"], wp["width"]) != (gp["generation"], gp["width"]):
            pcie.append((i, f"{_pcie_text(gp)} at most", _pcie_text(wp)))
    if model:
        lines.append(_per_gpu_line("GPU model", model, buses))
    if memory:
        lines.append(_per_gpu_line("GPU memory", memory, buses))
    if numa:
        lines.append(_per_gpu_line("NUMA node", numa, buses))
    if pcie:
        lines.append(_per_gpu_line("PCIe link", pcie, buses))

    want_links, got_links = pair_links(profile), pair_links(live)
    nvlink, path, p2p = [], [], []
    for (i, j), wl in sorted(want_links.items()):
        gl = got_links.get((i, j))
        if j >= n or gl is None:
            continue
        who = f"GPU{i}-GPU{j}"
        wc, gc = (wl.get("nvlink") or {}).get("count", 0), (gl.get("nvlink") or {}).get("count", 0)
        if wc != gc:
            nvlink.append((who, nvlink_label(gl), nvlink_label(wl)))
        if wl.get("pcie_path") and gl.get("pcie_path") and wl["pcie_path"] != gl["pcie_path"]:
            path.append((who, gl["pcie_path"], wl["pcie_path"]))
        if wl.get("p2p") is not None and gl.get("p2p") is not None and wl["p2p"] != gl["p2p"]:
            p2p.append((who, "supported" if gl["p2p"] else "unsupported", "supported" if wl["p2p"] else "unsupported"))
    if nvlink:
        lines.append("NVLink count: " + _grouped(nvlink, "{got} between {who}, profile expects {want}"))
    if path:
        lines.append("PCIe path: " + _grouped(path, "{got} between {who}, profile expects {want}"))
    if p2p:
        lines.append("P2P: " + _grouped(p2p, "{got} between {who}, profile expects {want}"))
    nic = _nic_line(profile, live, n)
    if nic:
        lines.append(nic)
    return lines


class TopologyMismatch(AotError):
    """The live machine differs from the artifact's profile. `lines` has one entry per mismatch class;
    `report` is true on the rank that should print them (local rank 0 of each node)."""

    def __init__(self, profile_name: str, lines: list[str], report: bool = True):
        self.profile_name, self.lines, self.report = profile_name, list(lines), report
        self.summary = (
            f"live topology differs from the artifact's profile {profile_name!r} in "
            f"{len(lines)} way{'s' if len(lines) != 1 else ''}"
            + (" (listed above)" if report else " (listed by local rank 0)")
            + "; --allow-topology-mismatch runs anyway, on a schedule tuned for other hardware"
        )
        super().__init__(
            f"live topology differs from the artifact's profile {profile_name!r}: " + "; ".join(lines) + " (--allow-topology-mismatch runs anyway)"
        )

    def refusal(self) -> "TopologyRefusal":
        """The one-line error `aot run` prints after the reporting rank has listed `lines`."""
        return TopologyRefusal(self.summary)


class TopologyRefusal(NodeRefusal):
    """`aot run`'s refusal to start: local rank 0 has listed the mismatches above this line."""


def verify_live(profile: dict, *, allow_mismatch: bool = False, warn=None, live: dict | None = None, env=None) -> list[str]:
    """Check this machine against `profile` before any collective. Raises TopologyMismatch unless
    `allow_mismatch`; then warns (on local rank 0 only, once per node) and returns the lines."""
    env = os.environ if env is None else env
    lead = env.get("LOCAL_RANK", "0") in ("", "0")
    live = live_profile(env=env) if live is None else live
    lines = mismatches(profile, live)
    if lines and not allow_mismatch:
        raise TopologyMismatch(profile["name"], lines, report=lead)
    if warn is not None and lead:
        if lines:
            warn(
                f"running on hardware that differs from the artifact's topology profile {profile['name']!r} "
                f"(--allow-topology-mismatch): its schedule was tuned for other hardware"
            )
            for line in lines:
                warn(f"topology mismatch: {line}")
        notes = live.get("probe", {}).get("notes", [])
        if profile["device_kind"] == "cuda" and live.get("probe", {}).get("source") == "torch":
            warn("NVML is not available: GPU links, PCIe paths, NUMA placement and NICs were not verified")
        elif profile["device_kind"] == "cuda":
            for note in notes:
                warn(f"topology probe: {note}")
    return lines
