"""The one interface between the planner's device-independent core and a device.

The core (graph analysis and memory in aot.plan.cost_model, the overlap simulation, the alpha-beta
formulas of aot.plan.collectives, bucketing in aot.plan.rebucket, the search, recomputation and
pipeline pricing) asks a device three things, in seconds, through `Machine.compute`:

- `op_seconds` / `view_seconds`: what one graph op costs on one rank (a view moves no data but
  is still dispatched);
- `collective_seconds`: what one collective costs in isolation, given the links its group crosses
  (`Machine.span`: alpha, beta and gamma per link class, from the profile or its calibration);
- `blocking_stall` / `collective_stall_s`: what collectives cost inside a step beyond that, where
  they block compute (`overlaps_communication` false: CPU ranks, whose gloo threads share the
  cores the ranks compute on), and nothing where they run beside it (GPUs: NCCL's own stream).

Two models implement it, chosen by the profile's device_kind in aot.plan.machine and imported
only then: aot.plan.gpu_model (peak x efficiency per op class, launches overlapping execution) and
aot.plan.cpu_gloo_model (CPU ranks' measured dispatch costs, cache bandwidths and in-step stall
distributions).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from aot.plan import collectives
from aot.plan.collectives import Span


class DeviceModel(ABC):
    """What one rank's device costs, in seconds. Subclasses set the attributes and implement
    `op_seconds` and `view_seconds`."""

    calibrated: bool = False  # rates measured on the live ranks (`aot topology calibrate`)
    overlaps_communication: bool = True  # collectives run beside compute instead of blocking it
    memory_bytes_per_s: float  # sustained memory bandwidth (a collective's reduction reads
    # its bytes once more at it: the links' gamma)
    collective_stall_s: float = 0.0  # mean stall of one blocking collective inside a step

    @abstractmethod
    def op_seconds(
        self, flops: float, nbytes: float, dtype: str, overhead: bool = True, *, target: str | None = None, elements: int = 0, launches: int = 1
    ) -> float:
        """One op (`target`: its aten name) doing `flops` on tensors of `dtype`, reading and
        writing `nbytes`, writing `elements` elements, in `launches` kernels (a foreach op: one per
        tensor of its list); without `overhead`, its work alone (no dispatch or launch)."""

    @abstractmethod
    def view_seconds(self) -> float:
        """One view op: dispatched, no data moved."""

    def collective_seconds(self, kind: str, algorithm: str, span: Span, nbytes: float) -> float:
        """One collective of `kind` over `nbytes` (n of the alpha-beta formulas) with `algorithm`,
        over the links `span` crosses, run on its own: aot.plan.collectives' formulas."""
        return collectives.cost(kind, algorithm, span, nbytes)

    def blocking_stall(self, segments: list[float], kinds: list[str] | None = None) -> float:
        """What a step pays in all, beyond their isolated times, for blocking collectives of `kinds`
        issued after `segments` seconds of compute each (since the ranks last met:
        aot.plan.cost_model._segments). Only asked where communication does not overlap."""
        return len(segments) * self.collective_stall_s
