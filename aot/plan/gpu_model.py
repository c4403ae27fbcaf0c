"""The GPU device model: each op at a fraction of the GPU's peak for its class, launches
overlapping execution, collectives on their own stream (NCCL).

Op classes (what bounds an op on a GPU), each a roofline of the class's rates:
- matmul-like: matmuls, convolutions and attention (the ops torch.utils.flop_counter counts FLOPs
  for, hence the only ops the graph analysis gives FLOPs): they run on the tensor cores, their
  FLOPs at GPU_MATMUL_EFFICIENCY (60%) of the dtype's dense peak (`peak_tflops`: bf16 for
  bfloat16, fp32 for float32, as PyTorch leaves TF32 off for matmuls), their bytes as below.
- memory-bound (elementwise ops, reductions, copies, the optimizer's foreach updates): their bytes
  at GPU_MEMORY_EFFICIENCY (80%) of the memory bandwidth; any FLOPs they carry run on the CUDA
  cores, not the tensor cores, at the same 60% of the fp32 (non-tensor) peak: a far lower fraction
  of the dense peak than a matmul's (A100: 19.5 of 312 TFLOP/s in bf16; H100 SXM: 67 of 989,
  /shared/reference/hardware.md's dense peaks).
Every op launches one kernel (GPU_LAUNCH_S, 5 us; a foreach op's tensors are fused into few
launches), and launches are asynchronous: they overlap the kernels before them, so an op costs
the larger of its launch and its work. A view launches nothing but is still dispatched: it costs a
launch. The 60/80% and 5 us are the planner's defaults from before the device models were split
(aot/plan/machine.py's docstring); collectives' alpha-beta per link class stays in aot.plan.machine
and aot.plan.collectives.

Calibrated (`aot topology calibrate` on NCCL ranks writes the profile's `compute` entry, see
aot/plan/calibrate.py): `flops_per_s` per dtype (a 2048x2048 matmul: the matmul class's rate;
float32 is also the CUDA cores' rate, TF32 being off), `memory_bytes_per_s` (a 512 MiB copy: the
memory-bound class's), `op_overhead_s` (the launch), `view_overhead_s` and `efficiency` (the
fraction of this roofline a reference training step reaches) replace the defaults; the CPU-only
tables of that entry do not apply to GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.flop_counter import flop_registry

import runner.execution.attention  # noqa: F401  (registers its fused attention's FLOP formulas before MATMUL_LIKE is read)
from aot.plan.device_model import DeviceModel

GPU_MATMUL_EFFICIENCY = 0.6  # of the dtype's dense peak, for matmul-like ops (and the CUDA cores' fp32 rate)
GPU_MEMORY_EFFICIENCY = 0.8  # of the memory bandwidth
GPU_LAUNCH_S = 5e-6
DEFAULT_FLOPS_PER_S = 1e13  # a GPU whose profile lists no fp32 peak
DEFAULT_MEMORY_GB_PER_S = 1000.0

MATMUL, MEMORY = "matmul", "memory"
# aten names of the ops torch's FLOP counter has formulas for: matmuls, convolutions, attention
MATMUL_LIKE = frozenset(getattr(op, "__name__", str(op)).split(".")[-1] for op in flop_registry)

DTYPE_PEAK = {  # torch dtype name -> the profile's peak_tflops keys to try, in order
    "float32": ("fp32",),
    "float64": ("fp64", "fp32"),
    "bfloat16": ("bf16", "fp16"),
    "float16": ("fp16", "bf16"),
    "float8_e4m3fn": ("fp8", "bf16"),
    "float8_e5m2": ("fp8", "bf16"),
    "int8": ("int8", "fp16"),
}


def op_class(target: str | None, flops: float) -> str:
    """MATMUL for the ops the FLOP counter knows (by name; unnamed: any op with FLOPs), else MEMORY."""
    if target is not None:
        return MATMUL if target in MATMUL_LIKE else MEMORY
    return MATMUL if flops else MEMORY


@dataclass(frozen=True)
class GpuModel(DeviceModel):
    """One GPU: a roofline per op class over an efficiency factor, launches overlapping execution."""

    flops_per_s: dict[str, float]  # torch dtype name (or "default") -> sustained matmul FLOP/s
    memory_bytes_per_s: float  # sustained memory bandwidth of memory-bound ops
    launch_s: float = GPU_LAUNCH_S  # one kernel launch
    elementwise_flops_per_s: float = 0.0  # the CUDA cores' rate (FLOPs of memory-bound ops); 0: flops_per_s's
    view_overhead_s: float | None = None  # dispatching a view; None: launch_s
    efficiency: float = 1.0  # measured fraction of the roofline real ops reach (calibration)
    calibrated: bool = False

    overlaps_communication = True  # NCCL kernels run on their own stream

    @classmethod
    def from_profile(cls, gpu: dict, measured: dict) -> "GpuModel":
        """The model of a profile's GPU (`gpu`: one entry of node.gpus) and, when calibrated, its
        `compute` entry (`measured`)."""
        peaks = gpu.get("peak_tflops") or {}
        flops = {}
        for dtype, keys in DTYPE_PEAK.items():
            for key in keys:
                if peaks.get(key):
                    flops[dtype] = peaks[key] * 1e12 * GPU_MATMUL_EFFICIENCY
                    break
        flops["default"] = flops.get("float32") or DEFAULT_FLOPS_PER_S
        bandwidth = (gpu.get("memory_bandwidth_gb_per_s") or DEFAULT_MEMORY_GB_PER_S) * 1e9 * GPU_MEMORY_EFFICIENCY
        if not measured:
            return cls(flops, bandwidth, elementwise_flops_per_s=flops["default"])
        for dtype, rate in (measured.get("flops_per_s") or {}).items():
            flops[dtype] = rate
        if "float32" in (measured.get("flops_per_s") or {}):
            flops["default"] = measured["flops_per_s"]["float32"]
        return cls(
            flops,
            measured.get("memory_bytes_per_s") or bandwidth,
            measured.get("op_overhead_s", GPU_LAUNCH_S),
            elementwise_flops_per_s=flops["default"],
            view_overhead_s=measured.get("view_overhead_s"),
            efficiency=measured.get("efficiency") or 1.0,
            calibrated=True,
        )

    def flops_rate(self, dtype: str, cls: str = MATMUL) -> float:
        if cls == MEMORY and self.elementwise_flops_per_s:
            return self.elementwise_flops_per_s
        return self.flops_per_s.get(dtype) or self.flops_per_s.get("default") or next(iter(self.flops_per_s.values()))

    def op_seconds(
        self, flops: float, nbytes: float, dtype: str, overhead: bool = True, *, target: str | None = None, elements: int = 0, launches: int = 1
    ) -> float:
        """The roofline of the op's class over the efficiency, at least one launch (launches overlap
        the kernels before them; a foreach op's tensors are fused)."""
        rate = self.flops_rate(dtype, op_class(target, flops))
        work = max(flops / rate if flops else 0.0, nbytes / self.memory_bytes_per_s if nbytes else 0.0) / self.efficiency
        return max(work, self.launch_s) if overhead else work

    def view_seconds(self) -> float:
        return self.launch_s if self.view_overhead_s is None else self.view_overhead_s
