"""Benchmark: training steps on gloo with gloo's poll threads yielded (nice 19) or left as started.

    python bench/gloo_poll_yield.py [--world 2] [--steps 40] [--repeats 2] [--strategies dp tp fsdp]

`aot run` lowers each gloo group's transport poll thread (`gloo_tcp_loop`) to nice 19
(runner.execution.groups.yield_gloo_poll_threads); `AOT_GLOO_YIELD=0` leaves it alone. For examples/mlp.py
and examples/gpt.py at each strategy (degree = --world), this builds one artifact (no ONNX) and
launches `torchrun --nproc-per-node W -m aot run ART --steps N --metrics M` with and without the
yield, back to back, `--repeats` times in alternating order. Step time: the median `step_time_s`
of steps 6..N on rank 0. A launch is relaunched (up to --attempts) while other processes use more
than --max-other-load cores; the table gives, per plan, both medians over the repeats and the
median of the per-repeat ratios (yielded / as started), which a drift of the machine's speed
between repeats leaves alone. Launch and load accounting are bench/plan_accuracy.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import plan_accuracy as pa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["examples/mlp.py", "examples/gpt.py"])
    ap.add_argument("--strategies", nargs="+", default=["dp", "tp", "fsdp"], help="Parallel kinds, each at degree --world.")
    ap.add_argument("--attempts", type=int, default=2)
    ap.add_argument("--max-other-load", type=float, default=0.3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="aot-gloo-yield-") as tmpdir:
        tmp = Path(tmpdir)
        plans = []
        for model in args.models:
            for kind in args.strategies:
                strategy = f"{kind}={args.world}"
                art = tmp / f"{Path(model).stem}.{kind}"
                pa.run(
                    pa.aot(
                        "build",
                        model,
                        "--world-size",
                        str(args.world),
                        "--strategy",
                        strategy,
                        "--batch-size",
                        str(args.batch_size),
                        "--no-onnx",
                        "--quiet",
                        "-o",
                        str(art),
                    ),
                    tmp / f"build.{art.name}.log",
                )
                plans.append({"model": Path(model).stem, "strategy": strategy, "artifact": art, "runs": {"0": [], "1": []}})
        for r in range(args.repeats):
            for plan in plans:
                for setting in ("0", "1") if r % 2 == 0 else ("1", "0"):
                    os.environ["AOT_GLOO_YIELD"] = setting  # pa.env() hands the children a copy of os.environ
                    tag = f"{plan['artifact'].name}.{setting}.{r}"
                    result = pa.measure(plan["artifact"], args.world, args.steps, tmp, tag, args.attempts, args.max_other_load)
                    plan["runs"][setting].append(result["step_s"] if result else None)
                    print(
                        f"{plan['model']} {plan['strategy']} yield={setting}: {result['step_s'] * 1e3:.2f} ms" if result else f"{tag}: failed", file=sys.stderr
                    )
        for plan in plans:
            pairs = [(a, b) for a, b in zip(plan["runs"]["0"], plan["runs"]["1"]) if a and b]
            if not pairs:
                continue
            rows.append(
                {
                    "model": plan["model"],
                    "strategy": plan["strategy"],
                    "as_started_ms": statistics.median(a for a, _ in pairs) * 1e3,
                    "yielded_ms": statistics.median(b for _, b in pairs) * 1e3,
                    "ratio": statistics.median(b / a for a, b in pairs),
                    "launches": [[a * 1e3, b * 1e3] for a, b in pairs],
                }
            )
    print("| model | plan | as started | yielded (nice 19) | yielded / as started |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['model']} | {row['strategy']} | {row['as_started_ms']:.2f} ms | {row['yielded_ms']:.2f} ms | {row['ratio']:.2f} |")
    if pa.FAILED_LAUNCHES:
        print(f"\n{len(pa.FAILED_LAUNCHES)} launch(es) failed: " + ", ".join(f["tag"] for f in pa.FAILED_LAUNCHES))
    if args.out:
        args.out.write_text(
            json.dumps({"world": args.world, "steps": args.steps, "repeats": args.repeats, "rows": rows, "failed_launches": pa.FAILED_LAUNCHES}, indent=1)
        )


if __name__ == "__main__":
    main()
