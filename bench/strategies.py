"""Benchmark: the sharded strategies side by side at 4 ranks, examples/gpt.py on this machine's CPUs.

    python bench/strategies.py [--steps 20] [--repeats 2] [--batch-size 8]

For each strategy (dp=4, fsdp=4, dp=2,tp=2, fsdp=2,tp=2, tp=4) the script builds an artifact
(`aot build --no-onnx`), reads what each rank holds from `aot inspect --json` (parameters, and
parameters + gradients + optimizer state) and the collectives of a step, then trains it with
`torchrun --nproc-per-node 4 -m aot run` and takes the median step time of steps 6..N from the
metrics file. Runs are interleaved over `--repeats` rounds so the strategies see the same machine
load; the table shows the median over rounds of each strategy's median step. Every strategy
uses the same global batch (batch size per data-parallel rank x data-parallel ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("dp=4", "fsdp=4", "dp=2,tp=2", "fsdp=2,tp=2", "tp=4")
WARMUP = 5


def data_parallel(strategy: str) -> int:
    degrees = {k: int(v) for k, v in (p.split("=") for p in strategy.split(","))}
    return degrees.get("dp", 1) * degrees.get("fsdp", 1)


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, args))}\n{r.stderr[-2000:]}")
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch / 4 (per rank under dp=4)")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        facts, times = {}, {s: [] for s in STRATEGIES}
        for s in STRATEGIES:
            art = tmp / s.replace(",", "_").replace("=", "")
            per_rank_batch = args.batch_size * 4 // data_parallel(s)
            run(
                py,
                "-m",
                "aot",
                "build",
                REPO / "examples" / "gpt.py",
                "--world-size",
                4,
                "--strategy",
                s,
                "--batch-size",
                per_rank_batch,
                "--no-onnx",
                "--quiet",
                "-o",
                art,
                env=env,
            )
            summary = json.loads(run(py, "-m", "aot", "inspect", art, "--json", env=env).stdout)
            program = summary["programs"]["train"]
            rank0 = summary["ranks"][0]
            facts[s] = {
                "params": rank0["parameters"],
                "state_bytes": rank0["training_state_bytes"],
                "collectives": program["collectives_per_step"],
                "bytes": program["collective_bytes_per_step"],
                "art": art,
            }
        for _ in range(args.repeats):
            for s in STRATEGIES:
                metrics = tmp / "metrics.jsonl"
                metrics.unlink(missing_ok=True)
                run(
                    py,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    4,
                    "-m",
                    "aot",
                    "run",
                    facts[s]["art"],
                    "--steps",
                    args.steps,
                    "--metrics",
                    metrics,
                    "--quiet",
                    env=env,
                )
                steps = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][WARMUP:]
                times[s].append(statistics.median(steps))
    base = statistics.median(times["dp=4"])
    print(f"{'strategy':<13} {'params/rank':>11} {'state/rank':>11} {'vs dp':>6} {'coll/step':>9} {'bytes/step':>11} {'step ms':>8} {'vs dp':>6}")
    for s in STRATEGIES:
        f, t = facts[s], statistics.median(times[s])
        print(
            f"{s:<13} {f['params']:>11,} {f['state_bytes'] / 2**10:>8.1f} KiB {f['state_bytes'] / facts['dp=4']['state_bytes']:>6.2f} "
            f"{f['collectives']:>9} {f['bytes'] / 2**10:>7.1f} KiB {t * 1e3:>8.1f} {t / base:>6.2f}"
        )
    print(f"rounds: {args.repeats}, steps {WARMUP + 1}..{args.steps} per run; global batch {args.batch_size * 4}")


if __name__ == "__main__":
    main()
