"""A topology profile seen by the cost model: devices, the link between any two, and the device
model (`Machine.compute`, aot.plan.device_model's interface) that prices ops and collectives' stall.

Ranks are physical as torchrun numbers them: rank r runs on node r // per_node and local device
r % per_node (its CUDA index; on a cpu profile, a process slot). Every number the planner uses
comes from here, from the profile's facts (link bandwidths, peak TFLOP/s, memory bandwidth) or,
when present, from its measured `calibration` (per link class) and `compute` entries, which
`aot topology calibrate` writes:

    "calibration": {"loopback": {"alpha_s": ..., "beta_s_per_byte": ..., "gamma_s_per_byte": ...,
                                 "per_kind": {"all_reduce": {"alpha_s": ..., "beta_s_per_byte": ...}, ...,
                                              "send_recv": {...}}}}  # send_recv: one point-to-point transfer
    "compute": {"flops_per_s": {"float32": ...}, "memory_bytes_per_s": ..., "op_overhead_s": ...,
                "view_overhead_s": ..., "efficiency": ...,
                # CPU ranks only (aot.plan.cpu_gloo_model):
                "bandwidth_by_bytes": [[bytes, bytes_per_s], ...],
                "element_seconds": {"gelu": ..., ...}, "foreach_tensor_s": ..., "dispatch_s": {"addmm": [one, per_tensor], ...},
                "collective_stall_s": ...,
                "collective_stall_by_segment": [[compute_s, [stall_s, ...]], ...],
                "collective_stall_by_kind": {"all_gather": [[compute_s, [stall_s, ...]], ...], ...}}

Defaults for what a profile does not say (documented with their source):
- NVLink at 80% of its per-direction rate (NCCL counts 20 of NVLink 3's 25 GB/s per link), PCIe at
  76% (NCCL counts 24 of Gen4 x16's 31.5 GB/s), half that again between GPUs without P2P (copies are
  staged through host memory), the network at its rail rate (NCCL uses rate / 8000).
- alpha per step: 2 us NVLink, 4 us PCIe, the fabric's latency_us or 8 us network (NCCL's per-hop
  latencies are 0.6-3.4 us NVLink, 1-5.7 us PCIe, 2.7-14 us network), 30 us loopback (gloo).
- gamma (reduction) one extra read of the bytes at memory bandwidth.
- Compute: the device model's (cuda profiles: aot.plan.gpu_model, matmul-like ops at 60% of the
  dtype's dense peak, memory-bound ops at 80% of the memory bandwidth, 5 us launches overlapping
  execution; cpu profiles: aot.plan.cpu_gloo_model, 20 GFLOP/s, 5 GB/s and 8 us per op uncalibrated,
  ops one after another). Each is imported only for its device_kind.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from aot.errors import AotError
from aot.plan.collectives import Link, Span
from aot.plan.device_model import DeviceModel

LOOPBACK, NVLINK, PCIE, NETWORK = "loopback", "nvlink", "pcie", "network"

PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563, 7: 15.125}
NVLINK_EFFICIENCY = 0.8
PCIE_EFFICIENCY = 0.76
NO_P2P_FACTOR = 0.5
DEFAULT_ALPHA = {NVLINK: 2e-6, PCIE: 4e-6, NETWORK: 8e-6, LOOPBACK: 30e-6}
DEFAULT_LOOPBACK_BYTES_PER_S = 2e9


def _gpus(profile: dict) -> list[dict]:
    gpus = profile.get("node", {}).get("gpus") or {}
    if isinstance(gpus, list):
        return sorted(gpus, key=lambda g: g.get("index", 0))
    return [g for _, g in sorted(gpus.items(), key=lambda kv: kv[1]["index"])]


def _pair_links(profile: dict) -> dict[tuple[int, int], dict]:
    gpus = profile.get("node", {}).get("gpus") or {}
    if not isinstance(gpus, dict):
        return {}
    index = {bus.upper(): g["index"] for bus, g in gpus.items()}
    out = {}
    for link in profile["node"].get("links", []):
        try:
            i, j = sorted(index[b.upper()] for b in link["gpus"])
        except KeyError:
            continue
        out[(i, j)] = link
    return out


class Machine:
    """`nodes` nodes of `per_node` ranks each, with the profile's links and compute rates."""

    def __init__(self, profile: dict, world_size: int | None = None):
        self.profile = profile
        self.name = profile["name"]
        self.device_kind = profile["device_kind"]
        self.backend = profile.get("backend") or ("nccl" if self.device_kind == "cuda" else "gloo")
        self.nodes = profile["nodes"]
        self.gpus = _gpus(profile) if self.device_kind == "cuda" else []
        if world_size is None:
            world_size = self.nodes * (len(self.gpus) or 1)
        if world_size % self.nodes:
            raise AotError(f"world size {world_size} does not split evenly over {self.nodes} node(s)")
        self.world_size = world_size
        self.per_node = world_size // self.nodes
        if self.gpus and self.per_node > len(self.gpus):
            raise AotError(f"{self.per_node} ranks per node but topology {self.name!r} has {len(self.gpus)} GPU(s) per node")
        self.calibration = profile.get("calibration") or {}
        self.compute = self._compute()  # the device model (aot.plan.device_model.DeviceModel)
        self.memory_bytes = min((g.get("memory_bytes") or 0 for g in self.gpus), default=0) or None
        self._links = _pair_links(profile)
        self._pair_cache: dict[tuple[int, int], tuple[str, Link]] = {}
        self._device_order: list[int] | None = None
        self._span_cache: dict[tuple, Span] = {}
        # (axis size, its stride in the layout, the devices laid onto) -> whether its groups ascend,
        # and the distinct spans of its groups (aot.plan.placement.place)
        self.axis_groups: dict[tuple, tuple[bool, list[Span]]] = {}

    # -- compute ----------------------------------------------------------------------------
    def _compute(self) -> DeviceModel:
        """The device model the profile's device_kind names, imported only then (planning for GPUs
        never loads the CPU gloo model's tables and stall statistics)."""
        measured = self.profile.get("compute") or {}
        if self.device_kind == "cuda":
            from aot.plan.gpu_model import GpuModel

            return GpuModel.from_profile(self.gpus[0] if self.gpus else {}, measured)
        from aot.plan.cpu_gloo_model import CpuGlooModel

        return CpuGlooModel.from_profile(measured)

    # -- ranks and links ----------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_of(self, rank: int) -> int:
        return rank % self.per_node

    def _gamma(self) -> float:
        return 1.0 / self.compute.memory_bytes_per_s

    def _measured(self, cls: str, kind: str | None) -> Link | None:
        cal = self.calibration.get(cls)
        if not cal:
            return None
        entry = (cal.get("per_kind") or {}).get(kind) if kind else None
        src = entry or cal
        gamma = src.get("gamma_s_per_byte", cal.get("gamma_s_per_byte", 0.0 if entry else self._gamma()))
        return Link(alpha=src["alpha_s"], beta=src["beta_s_per_byte"], gamma=gamma or 0.0)

    def pair(self, a: int, b: int) -> tuple[str, Link]:
        """(link class, nominal link) between two local devices of one node."""
        key = (min(a, b), max(a, b))
        if key in self._pair_cache:
            return self._pair_cache[key]
        if self.device_kind != "cuda" or not self.gpus:
            result = LOOPBACK, Link(DEFAULT_ALPHA[LOOPBACK], 1.0 / DEFAULT_LOOPBACK_BYTES_PER_S, self._gamma())
        else:
            link = self._links.get(key) or {}
            nv = link.get("nvlink")
            if nv:
                gbs = nv.get("gb_per_s_per_direction") or 25.0 * nv.get("count", 1)
                result = NVLINK, Link(DEFAULT_ALPHA[NVLINK], 1.0 / (gbs * 1e9 * NVLINK_EFFICIENCY), self._gamma())
            else:
                lanes = [self.gpus[i].get("pcie") for i in key if i < len(self.gpus)]
                rates = [PCIE_LANE_GB_PER_S.get(p["generation"], 1.969) * p["width"] for p in lanes if p]
                gbs = (min(rates) if rates else 16 * 1.969) * PCIE_EFFICIENCY
                if link.get("p2p") is False:
                    gbs *= NO_P2P_FACTOR
                result = PCIE, Link(DEFAULT_ALPHA[PCIE], 1.0 / (gbs * 1e9), self._gamma())
        self._pair_cache[key] = result
        return result

    def pair_bytes_per_s(self, a: int, b: int) -> float:
        return 1.0 / self.pair(a, b)[1].beta

    def network(self) -> Link:
        fabric = self.profile.get("fabric") or {}
        gbs = fabric.get("gb_per_s_per_rail")
        rates = [n["rate_gbit_per_s"] for n in self.profile.get("node", {}).get("nics", []) if n.get("rate_gbit_per_s")]
        if not gbs:
            gbs = (max(rates) / 8) if rates else 12.5
        alpha = (fabric.get("latency_us") or DEFAULT_ALPHA[NETWORK] * 1e6) * 1e-6
        if self.uniform and not (fabric.get("gb_per_s_per_rail") or rates):
            # Nothing known of the network between CPU nodes: never price it faster than the
            # loopback inside a node, or placement would send the busiest axis across nodes.
            _, loop = self.pair(0, 1)
            gbs, alpha = min(gbs, 1e-9 / loop.beta), max(alpha, loop.alpha)
        return Link(alpha, 1.0 / (gbs * 1e9), self._gamma())

    def rails(self) -> int:
        fabric = self.profile.get("fabric") or {}
        nics = [n for n in self.profile.get("node", {}).get("nics", []) if n.get("rate_gbit_per_s")]
        return max(1, fabric.get("rails_per_node") or len(nics) or 1)

    def span(self, ranks: list[int], kind: str | None = None) -> Span:
        """The links a group of physical ranks crosses, for a collective of `kind`.

        Inside a node the slowest pair bounds a ring; across nodes each node's share of the rails
        is its ranks' share of the node (all groups of one mesh axis communicate at once)."""
        # The span depends only on which local devices each node contributes: the groups of one
        # mesh axis are mostly translates of each other, so a search over 1024 ranks prices a few.
        key = (kind, self.contributions(ranks))
        if key not in self._span_cache:
            self._span_cache[key] = self._span(len(ranks), key[1], kind)
        return self._span_cache[key]

    def contributions(self, ranks: list[int]) -> tuple[tuple[tuple[int, ...], int], ...]:
        """((local devices, how many nodes contribute just those), ...) for a group of ranks,
        sorted. numpy where a node's devices fit in a bit mask: a group of a mesh over 16,384 ranks
        is walked a few thousand times in a search."""
        per = self.per_node
        if per > 62:
            by_node: dict[int, list[int]] = {}
            for r in ranks:
                by_node.setdefault(self.node_of(r), []).append(self.local_of(r))
            return tuple(sorted(Counter(tuple(sorted(v)) for v in by_node.values()).items()))
        node, local = np.divmod(np.asarray(ranks, dtype=np.int64), per)
        order = np.argsort(node, kind="stable")
        node = node[order]
        starts = np.flatnonzero(np.concatenate(([True], node[1:] != node[:-1])))
        masks, counts = np.unique(np.bitwise_or.reduceat(np.left_shift(1, local[order]), starts), return_counts=True)
        return tuple(sorted((tuple(i for i in range(per) if int(m) >> i & 1), int(c)) for m, c in zip(masks, counts)))

    @property
    def uniform(self) -> bool:
        """Whether every two ranks of a node talk over the same link (CPU ranks: loopback)."""
        return self.device_kind != "cuda" or not self.gpus

    def _span(self, p: int, contributions: tuple, kind: str | None) -> Span:
        nodes = sum(count for _, count in contributions)
        per_node = max(len(devices) for devices, _ in contributions)
        worst_cls, worst = None, None
        # one link inside a node: no need to look at every pair (a cpu profile of 1024 ranks has 500k)
        pairs = [devices for devices, _ in contributions] if not self.uniform else [[0, 1]] if per_node > 1 else []
        for locals_ in pairs:
            for i in range(len(locals_)):
                for j in range(i + 1, len(locals_)):
                    cls, link = self.pair(locals_[i], locals_[j])
                    if worst is None or link.beta > worst.beta or (link.beta == worst.beta and link.alpha > worst.alpha):
                        worst_cls, worst = cls, link
        if worst is None:  # one rank per node: nothing inside a node
            worst_cls, worst = self.pair(0, 1) if self.per_node > 1 else (LOOPBACK, Link(0.0, 0.0, self._gamma()))
        assert worst_cls is not None  # set together with worst
        intra = self._measured(worst_cls, kind) or worst
        if nodes == 1:
            return Span(p=p, intra=intra, nodes=1, per_node=per_node)
        inter = self._measured(NETWORK, kind) or self.network()
        rails = self.rails() * per_node / self.per_node
        return Span(p=p, intra=intra, nodes=nodes, per_node=per_node, inter=inter, rails=rails)

    # -- islands -----------------------------------------------------------------------------
    def device_order(self) -> list[int]:
        """Physical ranks ordered so that every island (devices joined by links at least as fast as
        some rate) is contiguous, fastest islands innermost, node by node."""
        if self._device_order is None:
            self._device_order = self._find_device_order()
        return list(self._device_order)

    def _find_device_order(self) -> list[int]:
        local = list(range(self.per_node))
        if self.uniform:  # one island: every pair of a node talks over the same link
            return list(range(self.world_size))
        rates = sorted({round(self.pair_bytes_per_s(i, j), 3) for i in local for j in local if i < j})

        def order(devices: list[int], level: int) -> list[int]:
            if level >= len(rates) or len(devices) <= 1:
                return sorted(devices)
            parent = {d: d for d in devices}

            def find(x):
                while parent[x] != x:
                    parent[x] = parent[parent[x]]
                    x = parent[x]
                return x

            for i in devices:
                for j in devices:
                    if i < j and round(self.pair_bytes_per_s(i, j), 3) >= rates[level]:
                        parent[find(i)] = find(j)
            comps: dict[int, list[int]] = {}
            for d in devices:
                comps.setdefault(find(d), []).append(d)
            groups = sorted(comps.values(), key=min)
            return [x for g in groups for x in order(g, level + 1)]

        inner = order(local, 0)
        return [n * self.per_node + d for n in range(self.nodes) for d in inner]

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.per_node} rank(s) of {self.name!r}"
