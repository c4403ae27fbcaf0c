"""A topology profile seen by the cost model: devices, the link between any two, compute rates.

Ranks are physical as torchrun numbers them: rank r runs on node r // per_node and local device
r % per_node (its CUDA index; on a cpu profile, a process slot). Every number the planner uses
comes from here, from the profile's facts (link bandwidths, peak TFLOP/s, memory bandwidth) or,
when present, from its measured `calibration` (per link class) and `compute` entries, which
`aot topology calibrate` writes:

    "calibration": {"loopback": {"alpha_s": ..., "beta_s_per_byte": ..., "gamma_s_per_byte": ...,
                                 "per_kind": {"all_reduce": {"alpha_s": ..., "beta_s_per_byte": ...}, ...}}}
    "compute": {"flops_per_s": {"float32": ...}, "memory_bytes_per_s": ...,
                "bandwidth_by_bytes": [[bytes, bytes_per_s], ...], "op_overhead_s": ..., "view_overhead_s": ..., "efficiency": ...,
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
- GPU compute at 60% of dense peak for the dtype, memory at 80% of its bandwidth, 5 us per
  kernel launch, launches overlapping execution (an op costs the larger of the two).
- An uncalibrated cpu rank: 20 GFLOP/s, 5 GB/s, 8 us per op, ops run one after another.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from aot.errors import AotError
from aot.plan.collectives import Link, Span

LOOPBACK, NVLINK, PCIE, NETWORK = "loopback", "nvlink", "pcie", "network"

PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563, 7: 15.125}
NVLINK_EFFICIENCY = 0.8
PCIE_EFFICIENCY = 0.76
NO_P2P_FACTOR = 0.5
DEFAULT_ALPHA = {NVLINK: 2e-6, PCIE: 4e-6, NETWORK: 8e-6, LOOPBACK: 30e-6}
DEFAULT_LOOPBACK_BYTES_PER_S = 2e9
GPU_COMPUTE_EFFICIENCY = 0.6
GPU_MEMORY_EFFICIENCY = 0.8
GPU_LAUNCH_S = 5e-6
CPU_DEFAULTS = {"flops_per_s": 2e10, "memory_bytes_per_s": 5e9, "op_overhead_s": 8e-6}

_DTYPE_PEAK = {  # torch dtype name -> the profile's peak_tflops keys to try, in order
    "float32": ("fp32",), "float64": ("fp64", "fp32"), "bfloat16": ("bf16", "fp16"), "float16": ("fp16", "bf16"),
    "float8_e4m3fn": ("fp8", "bf16"), "float8_e5m2": ("fp8", "bf16"), "int8": ("int8", "fp16"),
}


@dataclass(frozen=True)
class Compute:
    """How fast one rank computes: a roofline with an efficiency factor, plus a per-op cost."""
    flops_per_s: dict[str, float]          # torch dtype name (or "default") -> sustained FLOP/s
    memory_bytes_per_s: float
    op_overhead_s: float
    async_dispatch: bool                   # GPU: launches overlap execution; CPU: ops run in turn
    bandwidth_by_bytes: tuple = ()        # ((bytes, bytes/s), ...) ascending: an op touching at most `bytes`
                                           # moves them at that rate (CPU caches); else memory_bytes_per_s
    view_overhead_s: float | None = None   # dispatching a view (no data moved); None: op_overhead_s
    efficiency: float = 1.0                # measured fraction of the roofline real ops reach (calibration)
    calibrated: bool = False
    collective_stall_s: float = 0.0        # what a blocking collective costs inside a step beyond its
                                           # isolated time (ranks out of step, transport threads waiting
                                           # for cores the ranks compute on), on average; calibrated on CPU ranks
    collective_stall_by_segment: tuple = ()  # ((compute before it, seconds; equally likely stalls), ...)
                                             # ascending: its distribution by how long the ranks computed
                                             # (an all_reduce's; other kinds' where not in the next)
    collective_stall_by_kind: dict = field(default_factory=dict)  # kind -> the same table for that kind
    element_seconds: dict = field(default_factory=dict)  # op name -> measured seconds per element written
    foreach_tensor_s: float = 0.0          # CPU: what each tensor of a foreach op's list adds (one kernel each)
    dispatch_s: dict = field(default_factory=dict)  # CPU: op name -> (seconds of one call on tiny tensors
                                           # (one tensor for a foreach op), seconds each further tensor of a
                                           # foreach list adds); op_overhead_s is then what an op costs beyond it

    def blocking_stall(self, segments: list[float], kinds: list[str] | None = None) -> float:
        """The stall a step pays in all for blocking collectives issued after `segments` seconds
        of compute each (since the ranks last met: aot.plan.cost_model._segments), of `kinds`
        (unknown: the default table's): the median of the sum of one draw per collective from the
        distribution calibrated for its kind at that compute length (stall_distribution). On CPU
        ranks the stall is bimodal (most collectives pay little, a third wait a scheduler tick of
        ~4 ms), so one collective in a step usually costs its fast time while thirty cost their
        mean: the median step is what a run measures. It grows with the compute before the
        collective (ranks drift apart, and where they share cores are preempted mid-run)."""
        if not segments:
            return 0.0
        if not self.collective_stall_by_segment and not self.collective_stall_by_kind:
            return len(segments) * self.collective_stall_s
        counts: dict[tuple[str, int, float], int] = {}  # _stall_key -> draws
        for seconds, kind in zip(segments, kinds or [""] * len(segments)):
            key = self._stall_key(seconds, kind)
            counts[key] = counts.get(key, 0) + 1
        return median_of_sum(tuple((self._stall_values(*key), k) for key, k in sorted(counts.items())))

    def stall_distribution(self, seconds: float, kind: str = "") -> tuple:
        """The equally likely stalls of one blocking collective of `kind` after `seconds` of compute:
        between two calibrated run lengths, each quantile interpolated on a log scale of the compute
        (a data-parallel step's all_reduce after 11 ms of backward lies between the runs of 4 and
        17 ms: nearest-only, it took either's stall, 2.3 or 3.8-6.1 ms here); outside them, the
        nearest's."""
        return self._stall_values(*self._stall_key(seconds, kind))

    def _stall_key(self, seconds: float, kind: str) -> tuple[str, int, float]:
        """(kind whose table it draws from, "" for the default; table row; weight of the next row)"""
        kind = kind if kind in self.collective_stall_by_kind else ""
        return (kind, *_between(self._stall_table(kind), seconds))

    def _stall_values(self, kind: str, row: int, weight: float) -> tuple:
        table = self._stall_table(kind)
        if weight == 0.0:
            return table[row][1]
        low, high = table[row][1], table[row + 1][1]
        return tuple((1 - weight) * a + weight * b for a, b in zip(low, high))

    def _stall_table(self, kind: str) -> tuple:
        return self.collective_stall_by_kind.get(kind) or self.collective_stall_by_segment or self.collective_stall_by_kind["all_reduce"]

    def flops_rate(self, dtype: str) -> float:
        return self.flops_per_s.get(dtype) or self.flops_per_s.get("default") or next(iter(self.flops_per_s.values()))

    def op_seconds(self, flops: float, nbytes: float, dtype: str, overhead: bool = True, *,
                   target: str | None = None, elements: int = 0, launches: int = 1) -> float:
        """Roofline time of one op, plus (CPU) or at least (GPU) the per-op dispatch cost. An op
        with a measured time per element written (`element_seconds`: CPU kernels such as GELU or
        softmax are bound by their arithmetic, which FLOP counters leave out) takes at least that.
        On CPUs a foreach op runs one kernel per tensor of its list (`launches`), each adding
        `foreach_tensor_s` to the op's dispatch; GPUs fuse them."""
        work = self.work_seconds(flops, nbytes, dtype, target=target, elements=elements)
        if not overhead:
            return work
        if self.async_dispatch:
            return max(work, self.op_overhead_s)
        return work + self.op_overhead_s + self.dispatch_seconds(target, launches)

    def dispatch_seconds(self, target: str | None, launches: int = 1) -> float:
        """CPU: an op's measured call cost (`dispatch_s`; ops the calibration did not see cost the
        median of those it did), or, in profiles without the table, only what a foreach op's
        further tensors add."""
        if not self.dispatch_s:
            return (launches - 1) * self.foreach_tensor_s
        one, per_tensor = self.dispatch_s.get(target) or (self._median_dispatch, self.foreach_tensor_s)
        return one + (launches - 1) * per_tensor

    @functools.cached_property
    def _median_dispatch(self) -> float:
        return float(np.median([one for one, _ in self.dispatch_s.values()]))

    def work_seconds(self, flops: float, nbytes: float, dtype: str, *, target: str | None = None,
                     elements: int = 0) -> float:
        """The op's time beyond dispatch: roofline over the efficiency, or its measured rate."""
        bw = self.bandwidth(nbytes)
        work = max(flops / self.flops_rate(dtype) if flops else 0.0, nbytes / bw if nbytes else 0.0) / self.efficiency
        rate = self.element_seconds.get(target) if target and self.element_seconds else None
        return max(work, rate * elements) if rate else work

    def bandwidth(self, nbytes: float) -> float:
        for size, rate in self.bandwidth_by_bytes:
            if nbytes <= size:
                return rate
        return self.memory_bytes_per_s

    def view_seconds(self) -> float:
        return self.op_overhead_s if self.view_overhead_s is None else self.view_overhead_s


STALL_GRID_S = 1e-5   # the stall distribution is summed on a 10 us grid
STALL_EXACT_UP_TO = 256


@functools.lru_cache(maxsize=1024)
def median_of_sum(parts: tuple) -> float:
    """Median of the sum of independent draws: `parts` is ((values, k), ...), k draws from the
    equally likely `values` of each. Exact on a 10 us grid (the convolution of the
    distributions, through the FFT); past 256 draws in all the sum's median is its mean to well
    within the grid per draw (central limit)."""
    total = sum(k for _, k in parts)
    if total > STALL_EXACT_UP_TO:
        return float(sum(k * np.mean(values) for values, k in parts))
    low, spectra, size = 0, [], 1
    for values, k in parts:
        steps = np.rint(np.asarray(values, dtype=float) / STALL_GRID_S).astype(np.int64)
        low += k * int(steps.min())
        pmf = np.bincount(steps - steps.min()).astype(float) / len(steps)
        spectra.append((pmf, k))
        size += k * (len(pmf) - 1)
    n = 1 << max(0, (size - 1).bit_length())
    spectrum = np.ones(n // 2 + 1, dtype=complex)
    for pmf, k in spectra:
        spectrum *= np.fft.rfft(pmf, n) ** k
    cdf = np.cumsum(np.clip(np.fft.irfft(spectrum, n)[:size], 0.0, None))
    index = int(np.searchsorted(cdf, 0.5 * cdf[-1] - 1e-9))
    return (index + low) * STALL_GRID_S


STALL_WEIGHT_STEPS = 8  # interpolation weights in eighths: steps with many collectives share draws' distributions


def _between(table: tuple, seconds: float) -> tuple[int, float]:
    """(row, weight): `seconds` of compute lies `weight` of the way, on a log scale and in
    eighths, from the table's `row` to the next. Outside the table: its end row, weight 0. Where
    the two rows' quantile lists differ in length (hand-written profiles): the nearest row."""
    logs = [math.log(max(s, 1e-6)) for s, _ in table]
    at = math.log(max(seconds, 1e-6))
    if at <= logs[0]:
        return 0, 0.0
    if at >= logs[-1]:
        return len(table) - 1, 0.0
    row = max(i for i in range(len(table) - 1) if logs[i] <= at)
    span = logs[row + 1] - logs[row]
    weight = min(1.0, round((at - logs[row]) / span * STALL_WEIGHT_STEPS) / STALL_WEIGHT_STEPS) if span > 0 else 1.0
    if len(table[row][1]) != len(table[row + 1][1]):
        weight = 0.0 if weight < 0.5 else 1.0
    return (row + 1, 0.0) if weight >= 1.0 else (row, weight)


def _parsed_stall_table(table) -> tuple:
    return tuple((float(seconds), tuple(values)) for seconds, values in table or ())


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
        self.compute = self._compute()
        self.memory_bytes = min((g.get("memory_bytes") or 0 for g in self.gpus), default=0) or None
        self._links = _pair_links(profile)
        self._pair_cache: dict[tuple[int, int], tuple[str, Link]] = {}
        self._span_cache: dict[tuple, Span] = {}

    # -- compute ----------------------------------------------------------------------------
    def _compute(self) -> Compute:
        measured = self.profile.get("compute") or {}
        if self.device_kind == "cuda" and self.gpus:
            g = self.gpus[0]
            peaks = g.get("peak_tflops") or {}
            flops = {}
            for dtype, keys in _DTYPE_PEAK.items():
                for key in keys:
                    if peaks.get(key):
                        flops[dtype] = peaks[key] * 1e12 * GPU_COMPUTE_EFFICIENCY
                        break
            flops["default"] = flops.get("float32") or 1e13
            bw = (g.get("memory_bandwidth_gb_per_s") or 1000.0) * 1e9 * GPU_MEMORY_EFFICIENCY
            base = Compute(flops, bw, GPU_LAUNCH_S, async_dispatch=True)
        else:
            base = Compute({"default": CPU_DEFAULTS["flops_per_s"]}, CPU_DEFAULTS["memory_bytes_per_s"],
                           CPU_DEFAULTS["op_overhead_s"], async_dispatch=False)
        if not measured:
            return base
        flops = dict(base.flops_per_s)
        for dtype, rate in (measured.get("flops_per_s") or {}).items():
            flops[dtype] = rate
        if "float32" in (measured.get("flops_per_s") or {}):
            flops["default"] = measured["flops_per_s"]["float32"]
        return Compute(flops, measured.get("memory_bytes_per_s") or base.memory_bytes_per_s,
                       measured.get("op_overhead_s", base.op_overhead_s), base.async_dispatch,
                       bandwidth_by_bytes=tuple(sorted((float(b), float(r)) for b, r in measured.get("bandwidth_by_bytes") or ())),
                       view_overhead_s=measured.get("view_overhead_s"), efficiency=measured.get("efficiency") or 1.0,
                       calibrated=True, collective_stall_s=measured.get("collective_stall_s") or 0.0,
                       collective_stall_by_segment=_parsed_stall_table(measured.get("collective_stall_by_segment")),
                       collective_stall_by_kind={kind: _parsed_stall_table(table) for kind, table
                                                 in (measured.get("collective_stall_by_kind") or {}).items()},
                       element_seconds=dict(measured.get("element_seconds") or {}),
                       foreach_tensor_s=measured.get("foreach_tensor_s") or 0.0,
                       dispatch_s={k: (float(v[0]), float(v[1])) for k, v in (measured.get("dispatch_s") or {}).items()})

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
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.node_of(r), []).append(self.local_of(r))
        # The span depends only on which local devices each node contributes: the groups of one
        # mesh axis are mostly translates of each other, so a search over 1024 ranks prices a few.
        key = (kind, tuple(sorted(tuple(sorted(v)) for v in by_node.values())))
        if key not in self._span_cache:
            self._span_cache[key] = self._span(len(ranks), by_node, kind)
        return self._span_cache[key]

    @property
    def uniform(self) -> bool:
        """Whether every two ranks of a node talk over the same link (CPU ranks: loopback)."""
        return self.device_kind != "cuda" or not self.gpus

    def _span(self, p: int, by_node: dict[int, list[int]], kind: str | None) -> Span:
        nodes = len(by_node)
        per_node = max(len(v) for v in by_node.values())
        worst_cls, worst = None, None
        # one link inside a node: no need to look at every pair (a cpu profile of 1024 ranks has 500k)
        pairs = by_node.values() if not self.uniform else [[0, 1]] if per_node > 1 else []
        for locals_ in pairs:
            for i in range(len(locals_)):
                for j in range(i + 1, len(locals_)):
                    cls, link = self.pair(locals_[i], locals_[j])
                    if worst is None or link.beta > worst.beta or (link.beta == worst.beta and link.alpha > worst.alpha):
                        worst_cls, worst = cls, link
        if worst is None:  # one rank per node: nothing inside a node
            worst_cls, worst = self.pair(0, 1) if self.per_node > 1 else (LOOPBACK, Link(0.0, 0.0, self._gamma()))
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
