"""Benchmark: how long `aot plan` takes for a large machine.

    python bench/plan_scale.py [--model examples/gpt.py] [--size 8b] [--batch-size 2] [--topology dgx_a100] [--nodes 128]
                               [--repeats 3] [--axes dp,fsdp] [--workers N] [--code DIR] [--quiet-patience S]

Runs `aot plan MODEL --topology T --nodes N --json` as a fresh process `--repeats` times and
reports its wall time (process start to exit, interpreter and torch import included), the time the
command itself reports (`seconds`: from the command's start, after torch is imported), the CPU time
it used (on a machine other processes keep busy, the wall time is at least this over the cores
left), where the command says its time went (`time`: recording, tracing, pipeline programs,
pricing), how many candidate plans it priced and the best one. --size sets AOT_SIZE (the preset of
examples/llama.py: 8b, 70b). The foreign CPU load during each run
is recorded as in bench/plan_accuracy.py.

--code runs the aot of another checkout (e.g. `git clone` of the previous commit) with the same
interpreter, for figures side by side. --quiet-patience waits (up to that long) for a quiet
machine before each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_accuracy  # noqa: E402
from plan_accuracy import REPO, busy_cpu_s, env, own_cpu_s, wait_for_quiet  # noqa: E402  (env() puts plan_accuracy.CODE first on PYTHONPATH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="examples/gpt.py")
    ap.add_argument("--topology", default="dgx_a100")
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--axes", default=None, help="passed to `aot plan --axes` (default: the command's own)")
    ap.add_argument("--size", default=None, help="AOT_SIZE for the model file (examples/llama.py: 1b, 8b, 70b)")
    ap.add_argument("--batch-size", type=int, default=None, help="passed to `aot plan --batch-size`")
    ap.add_argument("--workers", type=int, default=None, help="passed to `aot plan --workers` (default: the command's own, one per core)")
    ap.add_argument("--code", type=Path, default=None, help="the checkout whose aot to run (default: this one)")
    ap.add_argument(
        "--quiet-patience", type=float, default=0.0, help="before each run, wait up to this many seconds for other processes to use at most 0.2 cores"
    )
    args = ap.parse_args()
    code = (args.code or REPO).resolve()
    plan_accuracy.CODE = code
    cmd = [sys.executable, "-m", "aot", "plan", args.model, "--topology", args.topology, "--nodes", str(args.nodes), "--json"]
    if args.axes:
        cmd += ["--axes", args.axes]
    if args.batch_size:
        cmd += ["--batch-size", str(args.batch_size)]
    if args.workers:
        cmd += ["--workers", str(args.workers)]
    environment = env()
    if args.size:
        environment["AOT_SIZE"] = args.size
    runs = []
    for _ in range(args.repeats):
        if args.quiet_patience > 0:
            wait_for_quiet(0.2, args.quiet_patience)
        t0, busy0, own0 = time.time(), busy_cpu_s(), own_cpu_s()
        out = subprocess.run(cmd, cwd=code, env=environment, capture_output=True, text=True, check=True)
        wall = time.time() - t0
        cpu = own_cpu_s() - own0
        other = max(0.0, (busy_cpu_s() - busy0) - cpu) / wall
        result = json.loads(out.stdout)
        runs.append(
            {
                "wall_s": wall,
                "command_s": result["seconds"],
                "cpu_s": cpu,
                "other_load_cores": other,
                "time": result.get("time"),
                "candidates": len(result["plans"]),
                "world_size": result["world_size"],
                "best": f"{result['plans'][0]['strategy']} bucket {result['plans'][0]['bucket_mb']:g} MiB",
            }
        )
        print(json.dumps(runs[-1]), file=sys.stderr)
    where = "" if code == REPO else f" ({code})"
    print(
        f"`{' '.join(cmd[1:])}`{where}: {runs[0]['world_size']} ranks, {runs[0]['candidates']} candidates, best {runs[0]['best']}; "
        f"wall {min(r['wall_s'] for r in runs):.1f} s best / {statistics.median(r['wall_s'] for r in runs):.1f} s median, "
        f"command-reported {statistics.median(r['command_s'] for r in runs):.1f} s median, "
        f"CPU {statistics.median(r['cpu_s'] for r in runs):.1f} s median, "
        f"foreign load {statistics.median(r['other_load_cores'] for r in runs):.2f} cores median" + (f"; AOT_SIZE={args.size}" if args.size else "")
    )


if __name__ == "__main__":
    main()
