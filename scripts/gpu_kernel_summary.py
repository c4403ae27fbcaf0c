"""Where a profiled GPU step's time goes, from `aot run --profile`'s trace (issue 25): run by
scripts/gpu_check.sh on the benchmark's profiled run.

    python scripts/gpu_kernel_summary.py PROFILE_DIR/measured_timeline.json > kernels.json

The cost model prices a GPU step from matmul and memory rates and a per-op cost; on the H200 it
predicted GPT-2's portable step 1.27x short even calibrated. This splits the measured step into the
GPU's kernels by class (matmul, attention, the rest: elementwise, reductions, copies), per profiled
step, and how much of the step the GPU was busy at all: a step the GPU idles through is bound by
the host issuing ops (the runner's per-op cost), not by the kernels the roofline prices.
"""

from __future__ import annotations

import json
import sys

# kernel name fragments (lower case) -> class; first match wins
CLASSES = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "matmul", "splitk")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, fragments in CLASSES:
        if any(f in low for f in fragments):
            return cls
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


def summarize(trace: dict) -> dict:
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return {"steps": len(steps), "note": "no GPU kernels in the trace (a CPU run?)"}
    start = min(s["ts"] for s in steps) if steps else min(k["ts"] for k in kernels)
    stop = max(s["ts"] + s["dur"] for s in steps) if steps else max(k["ts"] + k["dur"] for k in kernels)
    n = max(1, len(steps))
    inside = [k for k in kernels if start <= k["ts"] <= stop]
    by_class: dict[str, dict] = {}
    for k in inside:
        entry = by_class.setdefault(kernel_class(k.get("name", "")), {"ms_per_step": 0.0, "kernels_per_step": 0.0})
        entry["ms_per_step"] += k["dur"] / 1e3 / n
        entry["kernels_per_step"] += 1 / n
    top = {}
    for k in inside:
        top[k.get("name", "")[:120]] = top.get(k.get("name", "")[:120], 0.0) + k["dur"] / 1e3 / n
    span_ms = (stop - start) / 1e3 / n
    busy_ms = _union([(k["ts"], k["ts"] + k["dur"]) for k in inside]) / 1e3 / n
    return {
        "steps": len(steps),
        "step_ms": span_ms,
        "gpu_busy_ms": busy_ms,
        "gpu_busy_share": busy_ms / span_ms if span_ms else None,
        "by_class": {c: {k: round(v, 3) for k, v in e.items()} for c, e in sorted(by_class.items())},
        "top_kernels_ms_per_step": dict(sorted(((k, round(v, 3)) for k, v in top.items()), key=lambda kv: -kv[1])[:15]),
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(summarize(json.load(f)), indent=1))
