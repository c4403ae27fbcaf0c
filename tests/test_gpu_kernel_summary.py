"""scripts/gpu_kernel_summary.py on a trace shaped like torch.profiler's CUDA traces (the GPU check
reads the benchmark's profiled run with it; this machine records no kernels)."""

from __future__ import annotations

import importlib.util

from helpers.commands import REPO

_spec = importlib.util.spec_from_file_location("gpu_kernel_summary", REPO / "scripts" / "gpu_kernel_summary.py")
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)


def _x(name, ts, dur, cat="kernel"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_kernels_by_class_per_step_and_the_gpus_busy_share():
    trace = {
        "traceEvents": [
            _x("ProfilerStep#1", 0, 1000, "user_annotation"),
            _x("ProfilerStep#2", 1000, 1000, "user_annotation"),
            _x("sm90_xmma_gemm_bf16bf16_bf16f32", 100, 300),
            _x("pytorch_flash::flash_fwd_kernel", 350, 100),  # overlaps the gemm by 50 us
            _x("vectorized_elementwise_kernel<add>", 1200, 200),
            _x("Memcpy DtoD", 1500, 100, "gpu_memcpy"),
            _x("aten::mm", 100, 300, "cpu_op"),  # host side: not a kernel
        ]
    }
    s = summary.summarize(trace)
    assert s["steps"] == 2 and s["step_ms"] == 1.0
    assert s["by_class"]["matmul"] == {"ms_per_step": 0.15, "kernels_per_step": 0.5}
    assert s["by_class"]["attention"]["ms_per_step"] == 0.05
    assert s["by_class"]["other"] == {"ms_per_step": 0.15, "kernels_per_step": 1.0}
    assert s["gpu_busy_ms"] == (350 + 300) / 1e3 / 2  # the union: 100..450 and 1200..1400 and 1500..1600
    assert s["gpu_busy_share"] == s["gpu_busy_ms"] / 1.0
    assert summary.summarize({"traceEvents": [_x("ProfilerStep#1", 0, 10, "user_annotation")]})["note"].startswith("no GPU kernels")
