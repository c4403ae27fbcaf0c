"""Benchmark: expert parallelism at scale, as `aot build` predicts and makes it.

    python bench/moe_scale.py [--cases mixtral-8x7b:64:ep=8,fsdp=8:1.25;...] [--out results.json]

Each case is PRESET:WORLD:STRATEGY[:CAPACITY], cases separated by `;`. PRESET is one of
examples/moe.py's (`mixtral-8x7b`, `dsv3-like`; AOT_SIZE), CAPACITY a --moe-capacity-factor
(none: dropless). Every case is

    AOT_SIZE=PRESET aot build examples/moe.py --topology dgx_h100 --nodes WORLD/8 --world-size WORLD \\
        --strategy STRATEGY --batch-size 1 --precision bf16 [--moe-capacity-factor C] --no-onnx --no-eval

run as a fresh process (wall time: process start to exit; peak memory: the child's maximum
resident set, os.wait4). From the artifact: the predicted step (compute, exposed communication),
the bytes every rank sends per step by all_to_all (the token dispatch and its return, forward and
backward) and by all collectives, the predicted peak memory per rank, the training state per rank
(parameters, gradients, optimizer state) and the rows each rank sends each expert. The foreign CPU
load during each build is recorded as in bench/plan_accuracy.py, since this machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import REPO, busy_cpu_s, own_cpu_s  # noqa: E402

DEFAULT_CASES = ";".join(
    [
        "mixtral-8x7b:64:ep=8,fsdp=8:1.25",
        "mixtral-8x7b:64:ep=8,fsdp=8",
        "mixtral-8x7b:1024:ep=8,fsdp=128:1.25",
        "dsv3-like:64:ep=64:1.25",
        "dsv3-like:1024:ep=64,fsdp=16:1.25",
        "dsv3-like:1024:ep=8,fsdp=128:1.25",
    ]
)


def _measured(preset: str, world: int, strategy: str, capacity: str | None, out: Path) -> dict:
    cmd = [sys.executable, "-m", "aot", "build", "examples/moe.py", "--topology", "dgx_h100", "--nodes", str(max(1, world // 8))]
    cmd += ["--world-size", str(world), "--strategy", strategy, "--batch-size", "1", "--precision", "bf16", "--no-onnx", "--no-eval"]
    cmd += [*(["--moe-capacity-factor", capacity] if capacity else []), "-o", str(out), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AOT_SIZE": preset}
    log = out.with_suffix(".log")
    t0, busy0, own0 = time.time(), busy_cpu_s(), own_cpu_s()
    with open(log, "w") as err:
        child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.time() - t0
    foreign = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / wall
    row = {
        "preset": preset,
        "world": world,
        "strategy": strategy,
        "capacity_factor": float(capacity) if capacity else None,
        "build_s": round(wall, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "foreign_load_cores": round(foreign, 2),
    }
    if os.waitstatus_to_exitcode(status) != 0:
        return {**row, "error": log.read_text().strip()[-400:]}
    m = json.loads((out / "manifest.json").read_text())
    summary = json.loads(subprocess.run([sys.executable, "-m", "aot", "inspect", str(out), "--json"], cwd=REPO, capture_output=True, text=True).stdout)
    collectives = m["programs"]["train"]["collectives"]
    predicted = m["time"]["predicted"]
    ep = m["expert_parallel"]
    row.update(
        parameters=sum(_numel(shape) for shape, _ in m["state"]["params"].values()),
        step_s=predicted["step_s"],
        compute_s=predicted["compute_s"],
        exposed_comm_s=predicted["exposed_comm_s"],
        all_to_all_bytes=sum(c["bytes"] for c in collectives if c["kind"] == "all_to_all_single"),
        collective_bytes=sum(c["bytes"] for c in collectives),
        peak_bytes=m["memory"]["predicted"]["peak"],
        training_state_bytes=summary["ranks"][0]["training_state_bytes"],
        rows_per_expert=ep["capacity"]["rows"] if isinstance(ep["capacity"], dict) else "all",
        recompute=m["memory"].get("recompute", {}).get("policy"),
        commit=_commit(),
    )
    return row


def _commit() -> str:
    """The commit the build ran at, "-dirty" where the code (not the docs) had changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--", "aot", "runner", "examples"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return head + ("-dirty" if changed else "")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def table(rows: list[dict]) -> str:
    lines = [
        "| preset | ranks | strategy | capacity | rows/expert | predicted step | compute | exposed comm | all_to_all / rank / step "
        "| all collectives | peak / rank | state / rank | build s | foreign load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gib = 2**30
    for r in rows:
        cap = r["capacity_factor"] or "dropless"
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['world']} | {r['strategy']} | {cap} | failed: {r['error'].splitlines()[-1]} | | | | | | | | {r['build_s']} | |")
            continue
        lines.append(
            f"| {r['preset']} | {r['world']} | {r['strategy']} | {cap} | {r['rows_per_expert']} | {r['step_s']:.2f} s | {r['compute_s']:.2f} s | "
            f"{r['exposed_comm_s']:.2f} s | {r['all_to_all_bytes'] / gib:.1f} GiB | {r['collective_bytes'] / gib:.1f} GiB | {r['peak_bytes'] / gib:.1f} GiB | "
            f"{r['training_state_bytes'] / gib:.1f} GiB | {r['build_s']} | {r['foreign_load_cores']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="';'-separated PRESET:WORLD:STRATEGY[:CAPACITY]")
    ap.add_argument("--out", type=Path, help="write the rows and the machine to this JSON file")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="aot-moe-scale-") as scratch:
        for case in args.cases.split(";"):
            preset, world, strategy, *capacity = case.split(":")
            out = Path(scratch) / case.replace(":", "-").replace(",", "_").replace("=", "")
            try:
                row = _measured(preset, int(world), strategy, capacity[0] if capacity else None, out)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
