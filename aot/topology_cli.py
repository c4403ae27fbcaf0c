"""`aot topology probe|show|verify`: topology profiles from the command line.

A profile (docs/topology.md) is the hardware an artifact is built for; `aot run` checks the live
machine against it on every rank before the first collective. These commands make profiles
(`probe`, through NVML), read them (`show`, an `nvidia-smi topo -m` matrix with bandwidths) and
check a machine against one without running anything (`verify`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from runner.commands.console import debug_option

# PCIe per-lane, per-direction GB/s by generation (after 128b/130b encoding): x16 Gen4 = 31.5, Gen5 = 63.
PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563, 7: 15.125}

LEGEND = """\
Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
  ?    = not recorded in the profile
NIC cells other than a NIC's nearest GPUs are inferred from NUMA placement."""


def _pcie_gb_per_s(pcie: dict | None) -> float | None:
    if not pcie or pcie.get("generation") not in PCIE_LANE_GB_PER_S:
        return None
    return PCIE_LANE_GB_PER_S[pcie["generation"]] * pcie["width"]


def _table(rows: list[list[str]], gap: int = 2) -> list[str]:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    return [(" " * gap).join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]


def render(profile: dict) -> str:
    """The profile for people: summary, `nvidia-smi topo -m` matrix, bandwidths, GPUs, NICs, fabric."""
    from runner.hardware.topology import (
        describe,
        gib,
        gpu_label,
        gpus_in_order,
        nic_list,
        normalize_bus_id,
        pair_links,
        profile_sha256,
    )

    out = [f"topology {profile['name']}  (aot-topology v{profile['schema_version']}, sha256 {profile_sha256(profile)[:16]}...)"]
    if profile.get("description"):
        out.append(profile["description"])
    out.append(describe(profile) + (f"; backend {profile['backend']}" if profile["device_kind"] == "cuda" else ""))
    cpu = (profile.get("node") or {}).get("cpu") if isinstance(profile.get("node", {}).get("gpus"), dict) else None
    if cpu:
        facts = [cpu.get("model") or "model not recorded"]
        if cpu.get("sockets"):
            facts.append(f"{cpu['sockets']} socket{'s' if cpu['sockets'] != 1 else ''}")
        if cpu.get("logical_cpus"):
            facts.append(f"{cpu['logical_cpus']} logical CPUs")
        if cpu.get("numa_nodes"):
            facts.append(f"{len(cpu['numa_nodes'])} NUMA node{'s' if len(cpu['numa_nodes']) != 1 else ''}")
        out.append("CPU: " + ", ".join(facts))
    gpus = gpus_in_order(profile)
    if profile["device_kind"] != "cuda" or not gpus:
        if cpu and cpu.get("numa_nodes"):
            out += [f"  NUMA node {n}: CPUs {c}" for n, c in cpu["numa_nodes"].items()]
        return "\n".join(out + _calibration_lines(profile)) + "\n"
    if gpus[0][0] is None:  # a version-1 profile: GPUs without bus ids or links
        out += [f"  GPU{i}  {g['name']}  {gib(g['memory_bytes'])}" for i, (_, g) in enumerate(gpus)]
        return "\n".join(out) + "\n"

    index = {bus: g["index"] for bus, g in gpus}
    links = pair_links(profile)
    nics = nic_list(profile)
    n = len(gpus)
    numa = [g.get("numa_node") for _, g in gpus]

    def gpu_cell(i: int, j: int) -> str:
        if i == j:
            return "X"
        link = links.get((min(i, j), max(i, j)))
        if link is None:
            return "?"
        if link.get("nvlink"):
            return f"NV{link['nvlink']['count']}"
        return link.get("pcie_path") or "?"

    def nic_cell(nic: dict, i: int) -> str:
        near = {index[normalize_bus_id(b)] for b in nic.get("nearest_gpus", [])}
        if i in near:
            return nic.get("path_to_nearest") or "?"
        if nic.get("numa_node") is None or numa[i] is None:
            return "?"
        return "NODE" if nic["numa_node"] == numa[i] else "SYS"

    def nic_nic(a: dict, b: dict) -> str:
        if a is b:
            return "X"
        if a.get("nearest_gpus") and sorted(a["nearest_gpus"]) == sorted(b.get("nearest_gpus", [])):
            return a.get("path_to_nearest") or "?"
        if a.get("numa_node") is None or b.get("numa_node") is None:
            return "?"
        return "NODE" if a["numa_node"] == b["numa_node"] else "SYS"

    header = [""] + [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(len(nics))] + ["CPU Affinity", "NUMA Affinity"]
    rows = [header]
    for i, (_, g) in enumerate(gpus):
        rows.append(
            [f"GPU{i}"]
            + [gpu_cell(i, j) for j in range(n)]
            + [nic_cell(nic, i) for nic in nics]
            + [g.get("cpu_affinity") or "?", "?" if g.get("numa_node") is None else str(g["numa_node"])]
        )
    for k, nic in enumerate(nics):
        rows.append([f"NIC{k}"] + [nic_cell(nic, i) for i in range(n)] + [nic_nic(nic, other) for other in nics])
    out += ["", *_table(rows)]
    if nics:
        out += ["", "NIC Legend:"] + [f"  NIC{k}: {nic['name']}" + (f" port {nic['port']}" if nic.get("port") else "") for k, nic in enumerate(nics)]

    out += ["", "GB/s per direction between GPUs (NVLink; else PCIe P2P at the slower GPU's link; 'host' = no P2P, copies go through host memory):"]
    rows = [[""] + [f"GPU{i}" for i in range(n)]]
    for i, (_, gi) in enumerate(gpus):
        row = [f"GPU{i}"]
        for j, (_, gj) in enumerate(gpus):
            link = links.get((min(i, j), max(i, j)))
            if i == j:
                row.append("X")
            elif link is None:
                row.append("?")
            elif link.get("nvlink"):
                bw = link["nvlink"].get("gb_per_s_per_direction")
                row.append(f"{bw:g}" if bw else "?")
            elif link.get("p2p") is False:
                row.append("host")
            else:
                bws = [bw for bw in (_pcie_gb_per_s(gi.get("pcie")), _pcie_gb_per_s(gj.get("pcie"))) if bw is not None]
                row.append(f"{min(bws):.4g}" if len(bws) == 2 else "?")
        rows.append(row)
    out += _table(rows)

    out += ["", "GPUs:"]
    rows = []
    for i, (bus, g) in enumerate(gpus):
        assert bus is not None  # a version-2 profile keys its GPUs by bus id (version 1 returned above)
        cc = g.get("compute_capability")
        tf = g.get("peak_tflops") or {}
        flops = " / ".join(f"{d} {tf[d]:g}" for d in ("fp8", "bf16", "tf32", "fp32") if d in tf)
        rows.append(
            [
                f"  GPU{i}",
                bus,
                g["name"],
                f"sm_{cc[0]}{cc[1]}" if cc else "sm_?",
                gib(g["memory_bytes"]),
                f"{g['memory_bandwidth_gb_per_s']:g} GB/s" if g.get("memory_bandwidth_gb_per_s") else "? GB/s",
                (flops + " TFLOP/s") if flops else "TFLOP/s unknown",
                f"PCIe Gen{g['pcie']['generation']} x{g['pcie']['width']}" if g.get("pcie") else "PCIe ?",
                f"NUMA {g['numa_node']}" if g.get("numa_node") is not None else "NUMA ?",
            ]
        )
    out += _table(rows)
    if nics:
        out += ["", "NICs:"]
        rows = []
        for k, nic in enumerate(nics):
            near = [index[normalize_bus_id(b)] for b in nic.get("nearest_gpus", [])]
            rate = nic["rate_gbit_per_s"]
            rows.append(
                [
                    f"  NIC{k}",
                    nic["name"],
                    nic.get("link_layer") or "",
                    f"{rate:g} Gb/s" if rate else "down",
                    f"NUMA {nic['numa_node']}" if nic.get("numa_node") is not None else "NUMA ?",
                    f"nearest {gpu_label(near)} ({nic.get('path_to_nearest') or '?'})" if near else "not near a GPU",
                ]
            )
        out += _table(rows)
    fabric = profile.get("fabric")
    if fabric:
        per = f" at {fabric['gb_per_s_per_rail']:g} GB/s each" if fabric.get("gb_per_s_per_rail") else ""
        lat = f"{fabric['latency_us']:g} us latency" if fabric.get("latency_us") else "latency not measured"
        out += [
            "",
            f"Inter-node fabric: {fabric['kind']}, {fabric['rails_per_node']} rail(s) per node{per}, {lat}"
            + (f"; {profile['nodes']} nodes" if profile["nodes"] > 1 else ""),
        ]
    out += _calibration_lines(profile)
    out += ["", LEGEND]
    return "\n".join(out) + "\n"


def _calibration_lines(profile: dict) -> list[str]:
    """The measured alpha and beta per link class, and per collective kind and point-to-point
    (send_recv: a pipeline's stage transfers) where `aot topology calibrate` wrote them."""
    calibration = profile.get("calibration")
    if not calibration:
        return []

    def line(label: str, ab: dict) -> str:
        rate = f" ({1 / ab['beta_s_per_byte'] / 1e9:.3g} GB/s)" if ab["beta_s_per_byte"] else ""
        return f"{label} alpha {ab['alpha_s'] * 1e6:.3g} us  beta {ab['beta_s_per_byte']:.3g} s/B{rate}"

    out = ["", "Calibration (alpha: latency per message; beta: seconds per byte):"]
    for cls, ab in calibration.items():
        out.append(line(f"  {cls:<8}", ab))
        out += [line(f"    {kind:<15}", entry) for kind, entry in (ab.get("per_kind") or {}).items()]
    return out


@click.group("topology")
def topology():
    """Topology profiles: the hardware an artifact is built for, checked on every rank at start-up.

    A profile names GPUs by PCI bus id with their links (NVLink, PCIe path, P2P), NUMA placement,
    NICs and the inter-node fabric (docs/topology.md). PROFILE arguments are a built-in name
    (cpu, dgx_a100, dgx_h100, hgx_h200, pcie_4gpu_nvlink_pairs), a JSON file, or an artifact
    folder (its embedded profile).

    \b
        aot topology probe -o node.json     # this machine through NVML (CUDA_VISIBLE_DEVICES honoured)
        aot topology show dgx_a100          # the matrix, as nvidia-smi topo -m, with bandwidths
        aot topology verify artifacts/gpt   # does this machine match what the artifact was built for?
    """


@topology.command()
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the profile here (default: stdout).")
@click.option("--name", help="Profile name. Default: this machine's host name.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes of this type in the cluster the profile describes.")
@click.option("--quiet", is_flag=True, help="No summary or notes on stderr.")
@debug_option
def probe(output, name, nodes, quiet):
    """Write this machine's topology profile, read through NVML and sysfs.

    GPUs are those CUDA shows this process: CUDA_VISIBLE_DEVICES (indices or GPU-<uuid>) in
    CUDA_DEVICE_ORDER; each GPU's `index` is its CUDA device number. Without GPUs or NVML the
    result is this machine's CPU profile.
    """
    from runner.errors import AotError
    from runner.format.integrity import check_writable_target
    from runner.hardware.nvml_probe import probe as run_probe
    from runner.hardware.topology import describe, dumps_profile

    if output is not None:
        check_writable_target(output, "file")
    profile = run_probe(nodes=nodes, name=name)
    text = dumps_profile(profile)
    if output is None:
        click.echo(text, nl=False)
    else:
        tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, output)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise AotError(f"{output}: cannot write ({e.strerror})") from None
    if not quiet:
        for note in profile["probe"]["notes"]:
            click.echo(f"note: {note}", err=True)
        if output is not None:
            click.echo(f"wrote {profile['name']!r} ({describe(profile)}) to {output}", err=True)


@topology.command()
@click.argument("profile", required=False)
@click.option("--nodes", type=click.IntRange(min=1), help="Show it for this many nodes.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
@debug_option
def show(profile, nodes, as_json):
    """Print PROFILE (default: this machine, probed) as `nvidia-smi topo -m` does, with bandwidths."""
    from runner.hardware.nvml_probe import probe as run_probe
    from runner.hardware.topology import dumps_profile, for_nodes, load_profile

    p = load_profile(profile) if profile else run_probe()
    p = for_nodes(p, nodes)
    click.echo(dumps_profile(p) if as_json else render(p), nl=False)


@topology.command()
@click.argument("profile")
@click.option(
    "--nodes", type=click.IntRange(min=1), help="Nodes in the job this machine belongs to, checked against the profile's count. Default: not checked."
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@debug_option
def verify(profile, nodes, as_json):
    """Check this machine against PROFILE as `aot run` does at start-up; exit 1 on any mismatch.

    One line per mismatch class (node count, GPU count, model, memory, NUMA node, PCIe link,
    NVLink count, PCIe path, P2P, NIC), naming the GPUs involved. GPUs are compared in CUDA
    order (CUDA_VISIBLE_DEVICES honoured); tolerated: memory within 2%, the current PCIe
    generation (maxima are compared).
    """
    from runner.errors import AotError
    from runner.hardware.nvml_probe import live_profile
    from runner.hardware.topology import describe, load_profile
    from runner.hardware.topology_check import mismatches

    p = load_profile(profile)
    live = live_profile()
    live["nodes"] = nodes or p["nodes"]  # one machine cannot see the job's node count: --nodes says it
    live.pop("nodes_unknown", None)
    lines = mismatches(p, live)
    if as_json:
        click.echo(json.dumps({"profile": p["name"], "ok": not lines, "mismatches": lines, "live": describe(live), "expected": describe(p)}, indent=1))
        if lines:
            raise SystemExit(1)
        return
    if lines:
        for line in lines:
            click.echo(f"mismatch: {line}")
        raise AotError(f"this machine differs from topology {p['name']!r} in {len(lines)} way{'s' if len(lines) != 1 else ''} (listed above)")
    click.echo(f"this machine matches topology {p['name']!r}: {describe(p)}")
