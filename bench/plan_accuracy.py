"""Benchmark: the planner's predicted step time against measured step time, on this machine.

    python bench/plan_accuracy.py [--world 2] [--steps 40] [--repeats 3] [--profile cal.json] [--out results.json]

1. Calibrate (unless --profile): `torchrun --nproc-per-node W -m aot topology calibrate --profile cpu
   -o cal.json`, so alpha/beta of gloo's collectives, matmul FLOP/s, memory bandwidth, per-op cost
   and efficiency are this machine's, measured on W ranks at once.
2. Plan: `aot plan MODEL --topology cal.json --world-size W --json`: every candidate (dp x fsdp
   degrees, gradient bucket sizes) with its predicted step time.
3. Build every candidate (`aot build --strategy S --bucket-mb B`, no ONNX) and `--strategy auto`
   (whose manifest must name the predicted best).
4. Measure: `torchrun --nproc-per-node W -m aot run ART --steps N --metrics M`; the measured step
   time is the median `step_time_s` of steps 6..N (rank 0). Candidates run interleaved in a
   rotating order, `--repeats` times; each run records how many cores' worth of CPU *other*
   processes used meanwhile (/proc/stat minus our own children) and is relaunched, up to
   --attempts times, while that exceeds --max-other-load; the least disturbed launch is kept.
   Before the calibration and before every launch the script waits (up to 2 minutes) for a
   2-second window in which other processes use at most --max-other-load cores.

5. Calibrate again after the launches (unless --profile) and price the same plans with it
   ("predicted after"): on a VM whose speed drifts between the calibration and the launches,
   predictions before and after that bracket a measurement say the machine moved, not the model.

Children run a copy of aot/, runner/ and examples/ taken at the start (--no-snapshot: the working
tree). The table gives predicted and measured milliseconds, the error (predicted / measured - 1) and the
foreign load, and says whether the plan predicted best is the one measured best; where not, how far
behind it measured and whether the two plans' launches overlap (then these launches cannot order
them: run more --repeats), and the machine's speed before the launches against its speed before
the calibration (one core's matmul rate, and its copy rate on 64 MiB: on a VM the host can slow
either where /proc/stat shows no foreign load). Children get
OMP_NUM_THREADS=1 (torchrun's default). Everything is written in one temporary folder, removed
at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from aot.plan.timing import per_call  # noqa: E402  (the calibration's own timer)

CODE = REPO  # the tree the children run: a snapshot of REPO unless --no-snapshot
WARMUP_STEPS = 5
QUIET_PATIENCE = 120.0  # seconds to wait for a quiet machine before each calibration and run


def busy_cpu_s() -> float | None:
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.pathsep.join([str(CODE)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.pop("AOT_DEBUG", None)
    return e


def wait_for_quiet(max_load: float, patience: float) -> float | None:
    """Wait (up to `patience` seconds) for a 2-second window in which other processes use at most
    `max_load` cores; return the load of the last window."""
    deadline, load = time.time() + patience, None
    while True:
        busy0, own0, t0 = busy_cpu_s(), own_cpu_s(), time.time()
        time.sleep(2.0)
        if busy0 is None:
            return None
        load = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / (time.time() - t0)
        if load <= max_load or time.time() > deadline:
            return load


def machine_gflops() -> float:
    """This machine's speed now: one core's float32 matmul rate (256 x 256, median of 7 timings of
    20). Foreign processes are not the only thing that slows it: on this VM the host does too,
    invisibly to /proc/stat, and a calibration taken at one speed misprices runs at another."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    return 2 * 256**3 / per_call(lambda: a @ b, torch.device("cpu"), reps=7, inner=20) / 1e9


def machine_copy_gbs() -> float:
    """This machine's memory speed now: one core copying 64 MiB, far beyond the caches (GB/s moved,
    median of 7). The matmul rate runs from the core's own caches; a neighbour on the host that
    takes the memory bus or the shared cache slows a step's copies and elementwise kernels, not it."""
    import torch
    torch.set_num_threads(1)
    x = torch.empty(8 * 2**20)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / per_call(lambda: y.copy_(x), torch.device("cpu"), reps=7, inner=1) / 1e9


def run(cmd: list[str], log: Path, timeout: float = 900) -> tuple[float | None, float]:
    """Run cmd; return (cores' worth of CPU other processes used meanwhile, wall seconds)."""
    t0, busy0, own0 = time.time(), busy_cpu_s(), own_cpu_s()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=CODE, env=env(), stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.time() - t0
    busy1 = busy_cpu_s()
    other = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own_cpu_s() - own0)) / wall
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {shlex.join(cmd)}\n{log.read_text()[-3000:]}")
    return other, wall


def aot(*args) -> list[str]:
    return [sys.executable, "-m", "aot", *args]


def torchrun(world: int, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *args]


FAILED_LAUNCHES: list[dict] = []  # launches that crashed or hung (reported at the end, not retried forever)


def measure(art: Path, world: int, steps: int, tmp: Path, tag: str, attempts: int, max_load: float) -> dict:
    best = None
    for attempt in range(attempts):
        wait_for_quiet(max_load, QUIET_PATIENCE)
        speed, memory = machine_gflops(), machine_copy_gbs()
        metrics = tmp / f"metrics.{tag}.{attempt}.jsonl"
        try:
            other, _ = run(torchrun(world, "-m", "aot", "run", str(art), "--steps", str(steps), "--metrics", str(metrics),
                                    "--quiet", "--timeout", "120"), tmp / f"run.{tag}.{attempt}.log")
        except RuntimeError as e:  # a launch that failed counts as a used attempt, and is reported
            print(f"{tag}: launch {attempt + 1} FAILED: {str(e).splitlines()[0]}", file=sys.stderr)
            FAILED_LAUNCHES.append({"tag": tag, "attempt": attempt, "error": str(e)[-2000:]})
            continue
        times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines() if line.strip()]
        result = {"step_s": statistics.median(times[WARMUP_STEPS:]), "other_load_cores": other, "attempts": attempt + 1,
                  "machine_gflops": speed, "machine_copy_gbs": memory}
        if best is None or (other or 0) < (best["other_load_cores"] or 0):
            best = result
        if other is not None and other <= max_load:
            break
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["examples/mlp.py", "examples/gpt.py"])
    ap.add_argument("--profile", type=Path, help="A calibrated profile (default: calibrate now).")
    ap.add_argument("--max-candidates", type=int, default=6, help="Measure at most this many candidates per model (best first, then the worst).")
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--max-other-load", type=float, default=0.5, help="Cores of foreign CPU load above which a run is relaunched.")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-snapshot", action="store_true", help="Run the working tree, not a copy of it taken at the start.")
    args = ap.parse_args()

    results = {"world": args.world, "steps": args.steps, "repeats": args.repeats, "batch_size": args.batch_size,
               "nproc": os.cpu_count(), "models": {}}
    global CODE
    with tempfile.TemporaryDirectory(prefix="aot-plan-accuracy-") as tmpdir:
        tmp = Path(tmpdir)
        if not args.no_snapshot:  # others may edit the working tree while this runs
            CODE = tmp / "code"
            for part in ("aot", "runner", "examples"):
                shutil.copytree(REPO / part, CODE / part, ignore=shutil.ignore_patterns("__pycache__"))
        profile = args.profile
        if profile is None:
            profile = tmp / "cpu-calibrated.json"
            results["calibration"] = calibrate(args.world, profile, args.max_other_load, tmp)
        results["profile"] = json.loads(Path(profile).read_text())
        for model in args.models:
            name = Path(model).stem
            plan = plan_model(model, profile, args, tmp / f"plan.{name}.json")
            plans = plan["plans"]
            chosen = plans[:args.max_candidates - 1] + ([plans[-1]] if len(plans) >= args.max_candidates else [])
            candidates = []
            for i, p in enumerate(chosen):
                art = tmp / f"{name}.{i}"
                run(aot("build", model, "--topology", str(profile), "--world-size", str(args.world), "--strategy", p["strategy"],
                        "--bucket-mb", repr(p["bucket_mb"]), "--batch-size", str(args.batch_size), "--no-onnx", "--quiet", "-o", str(art)),
                    tmp / f"build.{name}.{i}.log")
                candidates.append({"strategy": p["strategy"], "bucket_mb": p["bucket_mb"], "predicted_step_s": p["step_s"],
                                   "predicted_rank": plans.index(p) + 1, "collectives_per_step": p["collectives_per_step"],
                                   "artifact": art, "runs": []})
            auto = tmp / f"{name}.auto"
            run(aot("build", model, "--topology", str(profile), "--world-size", str(args.world), "--strategy", "auto",
                    "--batch-size", str(args.batch_size), "--no-onnx", "--quiet", "-o", str(auto)), tmp / f"build.{name}.auto.log")
            auto_plan = json.loads((auto / "manifest.json").read_text()).get("plan", {})
            for r in range(args.repeats):
                order = candidates[r % len(candidates):] + candidates[:r % len(candidates)]
                for c in order:
                    tag = f"{name}.{candidates.index(c)}.{r}"
                    run_result = measure(c["artifact"], args.world, args.steps, tmp, tag, args.attempts, args.max_other_load)
                    if run_result is None:  # every attempt failed: reported with the results
                        continue
                    c["runs"].append(run_result)
                    print(f"{name} {c['strategy']} bucket {c['bucket_mb']:g}: {c['runs'][-1]['step_s'] * 1e3:.2f} ms "
                          f"(foreign load {c['runs'][-1]['other_load_cores'] or 0:.2f})", file=sys.stderr)
            candidates = [c for c in candidates if c["runs"]]  # a candidate whose every launch failed is left out
            for c in candidates:
                c["measured_step_s"] = statistics.median(x["step_s"] for x in c["runs"])
                c["other_load_cores"] = statistics.median(x["other_load_cores"] or 0 for x in c["runs"])
                c["machine_gflops"] = statistics.median(x["machine_gflops"] for x in c["runs"])
                c["machine_copy_gbs"] = statistics.median(x["machine_copy_gbs"] for x in c["runs"])
                c["error"] = c["predicted_step_s"] / c["measured_step_s"] - 1
                c["artifact"] = str(c["artifact"].name)
            measured_best = min(candidates, key=lambda c: c["measured_step_s"])
            results["models"][name] = {
                "parameters": plan["parameters"], "plan_seconds": plan["seconds"], "candidates": candidates,
                "predicted_best": candidates[0]["strategy"] + f" bucket {candidates[0]['bucket_mb']:g}",
                "measured_best": measured_best["strategy"] + f" bucket {measured_best['bucket_mb']:g}",
                "best_agrees": measured_best is candidates[0],
                **separation(candidates[0], measured_best),
                "auto_build": {"strategy": auto_plan.get("strategy"), "bucket_mb": auto_plan.get("bucket_mb"),
                               "predicted_step_s": (auto_plan.get("predicted") or {}).get("step_s")},
            }
        if args.profile is None:  # the same calibration after the launches: drift or the model's error?
            after = tmp / "cpu-calibrated-after.json"
            results["calibration_after"] = calibrate(args.world, after, args.max_other_load, tmp)
            for model in args.models:
                plans = plan_model(model, after, args, tmp / f"plan.{Path(model).stem}.after.json")["plans"]
                by_plan = {(p["strategy"], p["bucket_mb"]): p["step_s"] for p in plans}
                for c in results["models"][Path(model).stem]["candidates"]:
                    c["predicted_after_s"] = by_plan.get((c["strategy"], c["bucket_mb"]))
    results["failed_launches"] = FAILED_LAUNCHES
    print_table(results)
    for f in FAILED_LAUNCHES:
        print(f"failed launch: {f['tag']} attempt {f['attempt'] + 1}: {f['error'].splitlines()[0]}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")


def calibrate(world: int, profile: Path, max_load: float, tmp: Path) -> dict:
    """`aot topology calibrate` on `world` ranks into `profile`, once the machine is quiet."""
    wait_for_quiet(max_load, QUIET_PATIENCE)
    speed, memory = machine_gflops(), machine_copy_gbs()
    other, wall = run(torchrun(world, "-m", "aot", "topology", "calibrate", "--profile", "cpu", "-o", str(profile)),
                      tmp / f"{profile.stem}.log")
    print(f"calibrated in {wall:.1f} s (foreign load {other:.2f} cores)", file=sys.stderr)
    return {"seconds": wall, "other_load_cores": other, "machine_gflops": speed, "machine_copy_gbs": memory,
            "command": f"torchrun --nproc-per-node {world} -m aot topology calibrate --profile cpu -o cal.json"}


def plan_model(model: str, profile: Path, args, out_path: Path) -> dict:
    """`aot plan --json` of `model` on `profile`."""
    with open(out_path, "w") as out:
        subprocess.run(aot("plan", model, "--topology", str(profile), "--world-size", str(args.world),
                           "--batch-size", str(args.batch_size), "--json"), cwd=CODE, env=env(), stdout=out, check=True)
    return json.loads(out_path.read_text())


def separation(predicted: dict, measured: dict) -> dict:
    """How far the plan predicted best measured behind the one measured best (its median over the
    other's), and whether their launches overlap: the slowest launch of each slower than the
    fastest of the other, so that these launches cannot tell the two apart."""
    if predicted is measured:
        return {"best_margin": 0.0, "best_launches_overlap": False}
    p, m = [x["step_s"] for x in predicted["runs"]], [x["step_s"] for x in measured["runs"]]
    return {"best_margin": predicted["measured_step_s"] / measured["measured_step_s"] - 1,
            "best_launches_overlap": min(p) <= max(m) and min(m) <= max(p)}


def print_table(results: dict) -> None:
    base = (results.get("calibration") or {}).get("machine_gflops")
    base_copy = (results.get("calibration") or {}).get("machine_copy_gbs")
    print("| model | plan | predicted rank | predicted ms | measured ms | error | predicted after | foreign load (cores) "
          "| machine speed | memory speed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, m in results["models"].items():
        for c in m["candidates"]:
            speed = f"{c['machine_gflops'] / base:.2f}x" if base and c.get("machine_gflops") else "-"
            memory = f"{c['machine_copy_gbs'] / base_copy:.2f}x" if base_copy and c.get("machine_copy_gbs") else "-"
            after = c.get("predicted_after_s")
            after = f"{after * 1e3:.2f} ({after / c['measured_step_s'] - 1:+.0%})" if after else "-"
            print(f"| {name} | {c['strategy']}, bucket {c['bucket_mb']:g} MiB | {c['predicted_rank']} | "
                  f"{c['predicted_step_s'] * 1e3:.2f} | {c['measured_step_s'] * 1e3:.2f} | {c['error']:+.0%} | {after} | "
                  f"{c['other_load_cores']:.2f} | {speed} | {memory} |")
    if any(c.get("predicted_after_s") for m in results["models"].values() for c in m["candidates"]):
        print("predicted after: the same plan priced by a second calibration taken after the launches (its error against "
              "the measurement): where the two predictions bracket the measurement the machine drifted")
    if base:
        print(f"machine speed: one core's matmul rate before each launch, median over the launches, against "
              f"{base:.1f} GFLOP/s before the calibration")
    if base_copy:
        print(f"memory speed: one core copying 64 MiB before each launch, median over the launches, against "
              f"{base_copy:.1f} GB/s before the calibration")
    for name, m in results["models"].items():
        verdict = "agree" if m["best_agrees"] else f"DISAGREE: the predicted best measured {m['best_margin']:+.1%} behind"
        if m.get("best_launches_overlap"):
            verdict += ", their launches overlapping"
        print(f"{name}: predicted best {m['predicted_best']}, measured best {m['measured_best']} "
              f"({verdict}); --strategy auto built {m['auto_build']['strategy']} bucket {m['auto_build']['bucket_mb']}")


if __name__ == "__main__":
    main()
