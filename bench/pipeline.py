"""Benchmark: pipeline parallelism on CPU ranks, step time against dp=2 and the bubble, predicted and measured.

    python bench/pipeline.py [--rounds 3] [--steps 25] [--microbatches 2,4,8] [--schedules 1f1b,gpipe]
        [--mlp-microbatches 4] [--max-load 0.5] [--patience 60] [--topology cpu] [--out pipeline.json] [--commit ID]

Every variant is built for `--topology T --world-size 2 --no-onnx` (T: `--topology`, default the
uncalibrated cpu profile; a profile `aot topology calibrate` wrote on these ranks just before
prices this machine, point-to-point transfers included) and trained on 2 CPU ranks
with `torchrun --standalone --nproc-per-node 2 -m aot run ART --steps N --metrics M --profile P
--quiet` (OMP_NUM_THREADS=1), from this working tree:

- examples/gpt.py: dp=2 (`--strategy dp=2 --batch-size 8`: 8 rows per rank, a global batch of
  16) against pp=2 (`--strategy pp=2 --batch-size 16`: one data rank, the same global batch of 16)
  with `--microbatches` 2, 4 and 8 under `--pp-schedule` 1f1b and gpipe;
- examples/mlp.py (5 layers: interleaved-1f1b at pp=2 needs 4 stages, gpt.py has only 2
  blocks): dp=2 at batch 8 per rank against pp=2 at batch 16, 1f1b and interleaved-1f1b (2
  stages per rank), `--mlp-microbatches` microbatches.

The variants of a model are interleaved over --rounds rounds (each once per round, the order
reversed every other round) so that load on this shared machine hits them alike. Before each
launch the script waits (up to --patience seconds) for a 2-second window in which other processes
use at most --max-load cores, and records the cores' worth of CPU they used during the launch
(bench/plan_accuracy.py's measure).

Measured step: the median `step_time_s` of rank 0's `--metrics` lines after the first 6 steps
(5 warm-up steps; the 6th is also the last of `--profile`'s window, steps 2-6, which run under
torch.profiler), the median over rounds; "vs dp=2" is the ratio to the same model's dp=2 run of
the same round, then the median over rounds. Predicted step: the manifest's
`time.predicted.step_s` (for a pipeline, every pipeline rank's program simulated side by side,
aot/plan/pipeline_timeline.py).

Bubble, predicted two ways: the schedule's idle share with equal stages and free transfers,
(p - 1) / (v m + p - 1) (manifest `pipeline.predicted_bubble`, the issue's "predicted bubble"),
and the simulated one, `time.predicted.bubble_s / time.predicted.step_s`: the step less the
busiest pipeline rank's busy time, where the simulation counts a transfer's cost and the
pipeline-group all_reduce as waiting. Either way the bubble is the share of the step the
*busiest* rank sits idle. The matching measurement, from `--profile` (runner/execution/profiling.py,
`pipeline_wait`):
for each pipeline rank, the median over its profiled steps of (time in `wait_tensor` / that
step's duration), where the waits are those for receives (a neighbour stage has not sent yet), for
sends (waited at the end of the step) and for collectives (the end-of-step all_reduce over the
pipeline group, where the last stage waits while the first drains the schedule: 1F1B's trailing
bubble of the last stage is spent there, not in a transfer). Every rank's step ends at that
all_reduce, so the ranks' steps have one length, and the rank that waits least is the busiest.
**Measured bubble share = the least over pipeline ranks of that wait share**, the median over
rounds. It includes what the transfers and the all_reduce themselves cost on gloo (the
simulation counts those as waiting too; the equal-stages formula has no transfers), so on CPU it
reads high against the formula where those latencies are a large part of a short step; the
p2p-only share (receive and send waits) of the same rank is reported beside it. "measured /
predicted" is their ratio, for each prediction; the goal is within [0.8, 1.2].

--out writes every number (each round's, each rank's) as JSON; stdout gets the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import busy_cpu_s, own_cpu_s, wait_for_quiet  # noqa: E402

QUIET = (0.5, 60.0)  # before each launch: wait up to 60 s for others to use <= 0.5 cores (--max-load, --patience)
TIMED_FROM = 6  # metrics lines skipped: 5 warm-up steps, and step 6 is the profiler's last
GOAL = (0.8, 1.2)
TOPOLOGY = "cpu"  # --topology: the profile every variant is built for (a calibrated one prices this machine)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    return env


def variants(microbatches: list[int], schedules: list[str], mlp_microbatches: int) -> list[dict]:
    """Each variant: its name, model, build arguments, and the name of its dp=2 baseline."""
    out = [{"name": "gpt dp=2", "model": "gpt", "strategy": "dp=2", "args": ["--strategy", "dp=2", "--batch-size", 8]}]
    for schedule in schedules:
        for m in microbatches:
            out.append(
                {
                    "name": f"gpt pp=2 {schedule} m={m}",
                    "model": "gpt",
                    "strategy": "pp=2",
                    "schedule": schedule,
                    "microbatches": m,
                    "args": ["--strategy", "pp=2", "--batch-size", 16, "--microbatches", m, "--pp-schedule", schedule],
                }
            )
    out.append({"name": "mlp dp=2", "model": "mlp", "strategy": "dp=2", "args": ["--strategy", "dp=2", "--batch-size", 8]})
    for schedule in ("1f1b", "interleaved-1f1b"):
        out.append(
            {
                "name": f"mlp pp=2 {schedule} m={mlp_microbatches}",
                "model": "mlp",
                "strategy": "pp=2",
                "schedule": schedule,
                "microbatches": mlp_microbatches,
                "args": ["--strategy", "pp=2", "--batch-size", 16, "--microbatches", mlp_microbatches, "--pp-schedule", schedule],
            }
        )
    for v in out:
        v["baseline"] = f"{v['model']} dp=2"
    return out


def build(v: dict, out: Path) -> dict:
    started = time.perf_counter()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "aot",
            "build",
            f"examples/{v['model']}.py",
            "--topology",
            TOPOLOGY,
            "--world-size",
            "2",
            *map(str, v["args"]),
            "--no-onnx",
            "--quiet",
            "-o",
            str(out),
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise SystemExit(f"{v['name']}: build failed: {r.stderr[-2000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    pipeline = manifest.get("pipeline") or {}
    predicted = manifest["time"]["predicted"]
    bubble_s = predicted.get("bubble_s")
    return {
        "predicted_step_s": predicted["step_s"],
        "predicted_bubble_s": bubble_s,
        "predicted_bubble": pipeline.get("predicted_bubble"),
        "simulated_bubble": bubble_s / predicted["step_s"] if bubble_s is not None else None,
        "stages": [{"stage": s["stage"], "rank": s["rank"], "layers": s["layers"]} for s in pipeline.get("stages", [])],
        "programs": pipeline.get("programs"),
        "build_s": time.perf_counter() - started,
    }


FAILED_LAUNCHES: list[dict] = []  # launches that crashed and were run again (reported with the results)


def train(art: Path, steps: int, folder: Path) -> dict:
    """One launch, run once more if it crashes: the crash is kept (its whole stderr in
    failed-launch-K.stderr.txt in the working directory) and reported with the results."""
    try:
        return _train(art, steps, folder)
    except LaunchFailed as e:
        log = Path.cwd() / f"failed-launch-{len(FAILED_LAUNCHES) + 1}.stderr.txt"
        log.write_text(e.stderr)
        FAILED_LAUNCHES.append({"artifact": art.name, "returncode": e.returncode, "stderr": str(log)})
        print(f"  aot run {art.name} failed (exit {e.returncode}; stderr in {log}); running it again", file=sys.stderr, flush=True)
        return _train(art, steps, folder)


class LaunchFailed(Exception):
    def __init__(self, returncode: int, stderr: str):
        super().__init__(f"exit {returncode}")
        self.returncode, self.stderr = returncode, stderr


def _train(art: Path, steps: int, folder: Path) -> dict:
    metrics, profile = folder / "metrics.jsonl", folder / "profile"
    metrics.unlink(missing_ok=True)
    (profile / "profile.json").unlink(missing_ok=True)
    quiet = wait_for_quiet(*QUIET)
    started, busy0, own0 = time.perf_counter(), busy_cpu_s(), own_cpu_s()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "aot",
            "run",
            str(art),
            "--steps",
            str(steps),
            "--metrics",
            str(metrics),
            "--profile",
            str(profile),
            "--quiet",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise LaunchFailed(r.returncode, r.stderr)
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][TIMED_FROM:]
    summary = json.loads((profile / "profile.json").read_text())
    wall, busy1 = time.perf_counter() - started, busy_cpu_s()
    foreign = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own_cpu_s() - own0)) / wall
    run = {
        "step_s": statistics.median(times),
        "steps_timed": len(times),
        "run_s": wall,
        "load": os.getloadavg()[0],
        "foreign_load_before": quiet,
        "foreign_load": foreign,
    }
    waits = summary.get("pipeline_wait")
    if waits:
        ranks = [
            {k: r[k] for k in ("rank", "step_s", "p2p_wait_s", "recv_wait_s", "send_wait_s", "collective_wait_s", "p2p_share", "wait_share")}
            for r in waits["per_rank"]
        ]
        busiest = min(ranks, key=lambda r: r["wait_share"])
        run.update(ranks=ranks, busiest_rank=busiest["rank"], bubble=busiest["wait_share"], p2p_bubble=busiest["p2p_share"])
    return run


def measure(vs: list[dict], rounds: int, steps: int, folder: Path) -> list[dict]:
    for v in vs:
        v.update(build(v, folder / v["name"].replace(" ", "_")))
        print(f"  built {v['name']} in {v['build_s']:.1f} s", file=sys.stderr)
    runs: dict[str, list[dict]] = {v["name"]: [] for v in vs}
    for k in range(rounds):
        for model in dict.fromkeys(v["model"] for v in vs):
            mine = [v for v in vs if v["model"] == model]
            for v in mine if k % 2 == 0 else mine[::-1]:
                run = train(folder / v["name"].replace(" ", "_"), steps, folder)
                runs[v["name"]].append(run)
                extra = f", bubble {run['bubble']:.3f} (rank {run['busiest_rank']})" if "bubble" in run else ""
                foreign = f"{run['foreign_load']:.2f}" if run["foreign_load"] is not None else "?"
                print(
                    f"  round {k + 1} {v['name']}: {run['step_s'] * 1e3:.2f} ms{extra}, load average {run['load']:.2f}, other processes {foreign} cores",
                    file=sys.stderr,
                    flush=True,
                )
    results = []
    for v in vs:
        mine, base = runs[v["name"]], runs[v["baseline"]]
        row = {
            **{key: val for key, val in v.items() if key != "args"},
            "args": list(map(str, v["args"])),
            "runs": mine,
            "step_s": statistics.median(r["step_s"] for r in mine),
            "vs_dp": statistics.median(r["step_s"] / b["step_s"] for r, b in zip(mine, base)),
        }
        baseline = next(b for b in vs if b["name"] == v["baseline"])
        row["predicted_vs_dp"] = v["predicted_step_s"] / baseline["predicted_step_s"]
        if "bubble" in mine[0]:
            row["bubble"] = statistics.median(r["bubble"] for r in mine)
            row["bubble_range"] = [min(r["bubble"] for r in mine), max(r["bubble"] for r in mine)]
            row["p2p_bubble"] = statistics.median(r["p2p_bubble"] for r in mine)
            row["bubble_ratio"] = row["bubble"] / v["predicted_bubble"]
            row["goal_met"] = GOAL[0] <= row["bubble_ratio"] <= GOAL[1]
            if v["simulated_bubble"]:
                row["simulated_ratio"] = row["bubble"] / v["simulated_bubble"]
                row["simulated_goal_met"] = GOAL[0] <= row["simulated_ratio"] <= GOAL[1]
            row["per_rank"] = [
                {
                    key: statistics.median(r["ranks"][i][key] for r in mine)
                    for key in ("step_s", "recv_wait_s", "send_wait_s", "collective_wait_s", "p2p_share", "wait_share")
                }
                for i in range(len(mine[0]["ranks"]))
            ]
        results.append(row)
    return results


def report(rows: list[dict]) -> str:
    ms = lambda s: f"{s * 1e3:.2f}"
    lines = [
        "### Step time and bubble (2 CPU ranks, global batch 16)",
        "",
        "| variant | step, ms | vs dp=2 | predicted step, ms | predicted vs dp=2 | measured bubble (busiest rank) | "
        "range over rounds | of which p2p | predicted bubble (formula) | measured / formula | within 20% | predicted bubble (simulated) | "
        "measured / simulated | within 20% |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        line = f"| {r['name']} | {ms(r['step_s'])} | {r['vs_dp']:.2f} | {ms(r['predicted_step_s'])} | {r['predicted_vs_dp']:.2f} | "
        if "bubble" in r:
            busiest = statistics.mode(x["busiest_rank"] for x in r["runs"])
            yes = lambda ok: "yes" if ok else "no"
            line += (
                f"{r['bubble']:.3f} (rank {busiest}) | {r['bubble_range'][0]:.3f}-{r['bubble_range'][1]:.3f} | {r['p2p_bubble']:.3f} | "
                f"{r['predicted_bubble']:.3f} | {r['bubble_ratio']:.2f} | {yes(r['goal_met'])} | "
            )
            line += f"{r['simulated_bubble']:.3f} | {r['simulated_ratio']:.2f} | {yes(r['simulated_goal_met'])} |" if "simulated_ratio" in r else "- | - | - |"
        else:
            line += "- | - | - | - | - | - | - | - | - |"
        lines.append(line)
    lines += [
        "",
        "### Where each pipeline rank waits (profiled steps, medians over steps then rounds)",
        "",
        "| variant | rank | profiled step, ms | receive waits, ms | send waits, ms | collective waits, ms | p2p share | wait share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for i, x in enumerate(r.get("per_rank", [])):
            lines.append(
                f"| {r['name']} | {i} | {ms(x['step_s'])} | {ms(x['recv_wait_s'])} | {ms(x['send_wait_s'])} | "
                f"{ms(x['collective_wait_s'])} | {x['p2p_share']:.3f} | {x['wait_share']:.3f} |"
            )
    lines += [
        "",
        "### Stages (as built) and the simulated programs",
        "",
        "| variant | stages: pipeline rank, layers | predicted busy / waiting per program, ms |",
        "|---|---|---|",
    ]
    for r in rows:
        if r.get("stages"):
            stages = "; ".join(f"{s['stage']}: rank {s['rank']}, {', '.join(s['layers'])}" for s in r["stages"])
            programs = ", ".join(
                f"{n} {ms(p['busy_s'])} / {ms(p['waiting_s'])}" if "busy_s" in p else f"{n} {ms(p['step_s'])}" for n, p in sorted(r["programs"].items())
            )
            lines.append(f"| {r['name']} | {stages} | {programs} |")
    return "\n".join(lines)


def main() -> None:
    global QUIET, TOPOLOGY
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--microbatches", default="2,4,8", help="gpt.py's microbatch counts at pp=2")
    parser.add_argument("--schedules", default="1f1b,gpipe", help="gpt.py's schedules at pp=2")
    parser.add_argument("--mlp-microbatches", type=int, default=4)
    parser.add_argument("--max-load", type=float, default=QUIET[0], help="before each launch, wait for other processes to use at most this many cores")
    parser.add_argument("--patience", type=float, default=QUIET[1], help="seconds to wait for that, at most")
    parser.add_argument(
        "--topology", default="cpu", help="profile to build for (default cpu; a profile `aot topology calibrate` wrote on these ranks prices this machine)"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit", help="the commit to report (default: git rev-parse --short HEAD here; for a run from an exported tree)")
    args = parser.parse_args()
    QUIET, TOPOLOGY = (args.max_load, args.patience), str(Path(args.topology).resolve()) if Path(args.topology).is_file() else args.topology
    if args.steps <= TIMED_FROM:
        raise SystemExit(f"--steps must be more than {TIMED_FROM}")
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip() or "unknown"
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    vs = variants([int(m) for m in args.microbatches.split(",") if m], [s for s in args.schedules.split(",") if s], args.mlp_microbatches)
    with tempfile.TemporaryDirectory(prefix="aot-bench-pipeline-") as tmp:
        rows = measure(vs, args.rounds, args.steps, Path(tmp))
    print(report(rows))
    import torch

    loads = [r["load"] for row in rows for r in row["runs"]]
    foreign = [r["foreign_load"] for row in rows for r in row["runs"] if r["foreign_load"] is not None]
    machine = (
        f"commit {commit}, {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, "
        f"torch {torch.__version__}, load average {load_before:.2f} at start, {min(loads):.2f}-{max(loads):.2f} "
        f"after launches; other processes used {min(foreign, default=0):.2f}-{max(foreign, default=0):.2f} cores "
        f"(median {statistics.median(foreign) if foreign else 0:.2f}) during launches; {time.perf_counter() - started:.0f} s"
    )
    print(f"\n{machine}")
    for failed in FAILED_LAUNCHES:
        print(f"a launch of {failed['artifact']} crashed (exit {failed['returncode']}; stderr in {failed['stderr']}) and was run again")
    if args.out:
        record = {"commit": commit, "machine": machine, "rounds": args.rounds, "steps": args.steps, "rows": rows, "failed_launches": FAILED_LAUNCHES}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
