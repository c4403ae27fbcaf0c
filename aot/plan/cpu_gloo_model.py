"""The CPU gloo device model: CPU ranks (processes sharing a machine's cores) talking gloo.

On CPU ranks ops run one after another: an op costs its roofline work (over the measured
`efficiency`, at the bandwidth of the cache level its bytes fit: `bandwidth_by_bytes`, or at least
its measured time per element written: `element_seconds`) plus its call cost (`dispatch_s`, one
kernel per tensor of a foreach list: `foreach_tensor_s`) plus `op_overhead_s`. Collectives block
compute (gloo's threads copy and reduce on the cores the ranks compute on), and each blocking
collective pays a stall inside a step drawn from calibrated, bimodal distributions
(`collective_stall_by_segment`, `collective_stall_by_kind`), the step its median (median_of_sum).
aot/plan/calibrate.py and aot/plan/cpu_op_costs.py measure every table (`aot topology calibrate`
on CPU ranks: the profile's `compute` entry, described in aot/plan/machine.py).

Uncalibrated: 20 GFLOP/s, 5 GB/s, 8 us per op (CPU_DEFAULTS). aot.plan.machine imports this
module only for cpu profiles.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from aot.plan.device_model import DeviceModel

CPU_DEFAULTS = {"flops_per_s": 2e10, "memory_bytes_per_s": 5e9, "op_overhead_s": 8e-6}


@dataclass(frozen=True)
class CpuGlooModel(DeviceModel):
    """How fast one CPU rank computes: a roofline with an efficiency factor, plus per-op costs,
    ops in turn; and what its blocking collectives stall inside a step."""

    flops_per_s: dict[str, float]  # torch dtype name (or "default") -> sustained FLOP/s
    memory_bytes_per_s: float
    op_overhead_s: float
    bandwidth_by_bytes: tuple = ()  # ((bytes, bytes/s), ...) ascending: an op touching at most `bytes`
    # moves them at that rate (CPU caches); else memory_bytes_per_s
    view_overhead_s: float | None = None  # dispatching a view (no data moved); None: op_overhead_s
    efficiency: float = 1.0  # measured fraction of the roofline real ops reach (calibration)
    calibrated: bool = False
    collective_stall_s: float = 0.0  # what a blocking collective costs inside a step beyond its
    # isolated time (ranks out of step, transport threads waiting
    # for cores the ranks compute on), on average; calibrated on CPU ranks
    collective_stall_by_segment: tuple = ()  # ((compute before it, seconds; equally likely stalls), ...)
    # ascending: its distribution by how long the ranks computed
    # (an all_reduce's; other kinds' where not in the next)
    collective_stall_by_kind: dict = field(default_factory=dict)  # kind -> the same table for that kind
    element_seconds: dict = field(default_factory=dict)  # op name -> measured seconds per element written
    foreach_tensor_s: float = 0.0  # what each tensor of a foreach op's list adds (one kernel each)
    dispatch_s: dict = field(default_factory=dict)  # op name -> (seconds of one call on tiny tensors
    # (one tensor for a foreach op), seconds each further tensor of a
    # foreach list adds); op_overhead_s is then what an op costs beyond it

    overlaps_communication = False  # gloo's threads work on the cores the ranks compute on

    @classmethod
    def from_profile(cls, measured: dict) -> "CpuGlooModel":
        """The model a cpu profile's `compute` entry (empty: uncalibrated) describes."""
        base = cls({"default": CPU_DEFAULTS["flops_per_s"]}, CPU_DEFAULTS["memory_bytes_per_s"], CPU_DEFAULTS["op_overhead_s"])
        if not measured:
            return base
        flops = dict(base.flops_per_s)
        for dtype, rate in (measured.get("flops_per_s") or {}).items():
            flops[dtype] = rate
        if "float32" in (measured.get("flops_per_s") or {}):
            flops["default"] = measured["flops_per_s"]["float32"]
        return cls(
            flops,
            measured.get("memory_bytes_per_s") or base.memory_bytes_per_s,
            measured.get("op_overhead_s", base.op_overhead_s),
            bandwidth_by_bytes=tuple(sorted((float(b), float(r)) for b, r in measured.get("bandwidth_by_bytes") or ())),
            view_overhead_s=measured.get("view_overhead_s"),
            efficiency=measured.get("efficiency") or 1.0,
            calibrated=True,
            collective_stall_s=measured.get("collective_stall_s") or 0.0,
            collective_stall_by_segment=_parsed_stall_table(measured.get("collective_stall_by_segment")),
            collective_stall_by_kind={kind: _parsed_stall_table(table) for kind, table in (measured.get("collective_stall_by_kind") or {}).items()},
            element_seconds=dict(measured.get("element_seconds") or {}),
            foreach_tensor_s=measured.get("foreach_tensor_s") or 0.0,
            dispatch_s={k: (float(v[0]), float(v[1])) for k, v in (measured.get("dispatch_s") or {}).items()},
        )

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

    def op_seconds(
        self, flops: float, nbytes: float, dtype: str, overhead: bool = True, *, target: str | None = None, elements: int = 0, launches: int = 1
    ) -> float:
        """Roofline time of one op plus its dispatch cost. An op with a measured time per element
        written (`element_seconds`: CPU kernels such as GELU or softmax are bound by their
        arithmetic, which FLOP counters leave out) takes at least that. A foreach op runs one
        kernel per tensor of its list (`launches`), each adding `foreach_tensor_s` to its dispatch."""
        work = self.work_seconds(flops, nbytes, dtype, target=target, elements=elements)
        if not overhead:
            return work
        return work + self.op_overhead_s + self.dispatch_seconds(target, launches)

    def dispatch_seconds(self, target: str | None, launches: int = 1) -> float:
        """An op's measured call cost (`dispatch_s`; ops the calibration did not see cost the
        median of those it did), or, in profiles without the table, only what a foreach op's
        further tensors add."""
        if not self.dispatch_s:
            return (launches - 1) * self.foreach_tensor_s
        one, per_tensor = self.dispatch_s.get(target) or (self._median_dispatch, self.foreach_tensor_s)
        return one + (launches - 1) * per_tensor

    @functools.cached_property
    def _median_dispatch(self) -> float:
        return float(np.median([one for one, _ in self.dispatch_s.values()]))

    def work_seconds(self, flops: float, nbytes: float, dtype: str, *, target: str | None = None, elements: int = 0) -> float:
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


STALL_GRID_S = 1e-5  # the stall distribution is summed on a 10 us grid
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
