"""Benchmark: exported inference on ONNX Runtime vs eager PyTorch, batch 1 and 32, on this CPU.

    python bench/onnx_latency.py [--model examples/gpt.py] [--batch-sizes 1,32] [--rounds 5] [--out results.json]

Builds the model file once with `aot build` (whose ONNX stage exports the forward without its
weights; `runner.execution.infer` attaches the initial ones, replayed from the artifact's init program),
then, for each batch size, times the artifact's export through `runner.execution.infer` (ONNX
Runtime, CPUExecutionProvider, graph optimizations at the extended level, as `aot infer` runs it)
and the same model in eager PyTorch (`torch.no_grad()`, eval mode), side by side in one process
with the same number of threads. Both warm up first; then `--rounds` rounds alternate the two
(each round times `--iters` calls of each, one call = one forward of the whole batch), so both see
the same machine load. Reports the median and 90th percentile of single-call latency and the
throughput, and checks that the outputs agree. On a shared machine, the CPU that *other*
processes used during each measurement (/proc/stat less this process) is printed alongside:
compare the ratio more than the absolute figures, and trust runs whose foreign load is low.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import runner.execution.infer  # noqa: E402
from aot.capture.model_file import load_model_file  # noqa: E402


def _busy_s() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux /proc/stat), or None."""
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """How many cores' worth of CPU other processes used while the block ran."""

    def __enter__(self):
        self.busy, self.own, self.wall = _busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy = _busy_s()
        wall = time.perf_counter() - self.wall
        own = time.process_time() - self.own
        self.cores = None if busy is None or self.busy is None else max(0.0, (busy - self.busy - own) / wall)


def timed(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "gpt.py")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=0, help="Calls per round and side (default: 40 at batch 1, fewer for larger batches).")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="aot-onnx-bench-") as tmp:
        art = Path(tmp) / "art"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "aot", "build", str(args.model), "-o", str(art), "--quiet", "--onnx"], cwd=REPO, check=True)
        build_s = time.perf_counter() - start
        manifest = json.loads((art / "manifest.json").read_text())
        session = runner.execution.infer.load(art, "cpu", threads=args.threads)

        mf = load_model_file(args.model)
        torch.manual_seed(manifest["build"]["seed"])
        model = mf.model().eval()

        rows = []
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            result = mf.batch(batch_size)[0]
            inputs = [result] if isinstance(result, torch.Tensor) else list(result)
            feeds = session.feeds(inputs)
            names = session.output_names

            def eager():
                with torch.no_grad():
                    return model(*inputs)

            def ort():
                return session.session.run(names, feeds)

            with torch.no_grad():
                expected = torch.utils._pytree.tree_leaves(model(*inputs))
            got = ort()
            diff = max((e.double() - torch.from_numpy(g).double()).abs().max().item() for e, g in zip(expected, got))
            iters = args.iters or max(5, 40 // max(1, batch_size // 4))
            timed(eager, args.warmup)
            timed(ort, args.warmup)
            t_eager, t_ort = [], []
            with ForeignLoad() as foreign:
                for _ in range(args.rounds):
                    t_eager += timed(eager, iters)
                    t_ort += timed(ort, iters)
            row = {"batch_size": batch_size, "calls_per_side": len(t_eager), "max_abs_diff": diff, "foreign_load_cores": foreign.cores}
            for name, times in (("eager", t_eager), ("onnxruntime", t_ort)):
                row[name] = {
                    "p50_ms": float(np.percentile(times, 50)) * 1e3,
                    "p90_ms": float(np.percentile(times, 90)) * 1e3,
                    "samples_per_s": batch_size * len(times) / sum(times),
                }
            row["speedup_p50"] = row["eager"]["p50_ms"] / row["onnxruntime"]["p50_ms"]
            rows.append(row)

    report = {
        "model": str(args.model.relative_to(REPO) if args.model.is_relative_to(REPO) else args.model),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "torch": torch.__version__,
        "onnxruntime": __import__("onnxruntime").__version__,
        "provider": runner.execution.infer.PROVIDERS[session.provider],
        "opset": manifest["inference"]["opset"],
        "build_s": build_s,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }
    print(
        f"{report['model']} on {report['machine']}, {args.threads} threads; torch {report['torch']}, "
        f"onnxruntime {report['onnxruntime']} ({report['provider']}, extended graph optimizations), opset {report['opset']}"
    )
    print(f"load average before/after: {load_before[0]:.2f} / {report['load_average_after'][0]:.2f}; `aot build` with ONNX export: {build_s:.1f} s\n")
    print("| batch | eager p50 | eager p90 | eager samples/s | ORT p50 | ORT p90 | ORT samples/s | speed-up (p50) | max abs diff | other processes' load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        e, o = r["eager"], r["onnxruntime"]
        print(
            f"| {r['batch_size']} | {e['p50_ms']:.2f} ms | {e['p90_ms']:.2f} ms | {e['samples_per_s']:.0f} "
            f"| {o['p50_ms']:.2f} ms | {o['p90_ms']:.2f} ms | {o['samples_per_s']:.0f} | {r['speedup_p50']:.2f}x | {r['max_abs_diff']:.1e} "
            f"| {'?' if r['foreign_load_cores'] is None else format(r['foreign_load_cores'], '.1f') + ' cores'} |"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
