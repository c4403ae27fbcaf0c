"""Benchmark: the planner's predicted step time against measured step time, on this machine.

    python bench/plan_accuracy.py [--world 2] [--seconds 5] [--repeats 3] [--profile cal.json] [--out results.json]

1. Calibrate (unless --profile): `torchrun --nproc-per-node W -m aot topology calibrate --profile
   cpu -o cal.json`, so alpha/beta of gloo's collectives, matmul FLOP/s, memory bandwidth, per-op
   cost and efficiency are this machine's, measured on W ranks at once.
2. Plan: `aot plan MODEL --topology cal.json --world-size W --json`: every candidate (dp x fsdp x tp
   degrees, gradient bucket sizes) with its predicted step time.
3. Build the measured candidates (the best --max-candidates - 1 and the worst: `aot build
   --strategy S --bucket-mb B`, no ONNX) and `--strategy auto` (whose manifest must name the
   predicted best).
4. Measure, in --repeats rounds: each round launches every candidate of every model once
   (`torchrun --nproc-per-node W -m aot run ART --steps N --metrics M`, N = 5 warm-up steps plus
   --seconds of predicted steps, at least --steps in all), in an order that rotates from round to
   round. A launch's time is the median `step_time_s` of its steps after warm-up (rank 0); a plan's
   measured time is the median over its launches. Each launch records how many cores' worth of CPU
   *other* processes used meanwhile (/proc/stat minus our own children) and is relaunched, up to
   --attempts times, while that exceeds --max-other-load; the least disturbed launch is kept.
   Before each calibration and launch the script waits (up to 2 minutes) for a 2-second window in
   which other processes use at most --max-other-load cores.
5. Between rounds and after the last, calibrate again and price every measured plan with it
   (unless --profile). "Predicted" is the first calibration's price, the one `aot build --strategy
   auto` acts on; "bracketed" prices each launch by the mean of the calibrations just before and
   just after its round. On a VM whose speed drifts over minutes (by up to 1.6x in 25 minutes on
   the one in BENCHMARKS.md) the first says how far a prediction made once holds, the second how
   good the model is at the speed the machine had when it was measured.

Children run a copy of aot/, runner/ and examples/ taken at the start (--no-snapshot: the working
tree), with OMP_NUM_THREADS=1 (torchrun's default). The table gives predicted, bracketed and
measured milliseconds with each launch's, the errors (predicted / measured - 1) and the foreign
load; then, per model, whether the plan predicted best is the one measured best (where not, how far
behind it measured and whether the two plans' launches overlap: then these launches cannot order
them) and how many of the calibrations price the measured best first. --out writes all of it as
JSON, every calibration's profile included. Everything else is written in one temporary folder,
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
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
        metrics = tmp / f"metrics.{tag}.{attempt}.jsonl"
        try:
            other, _ = run(
                torchrun(world, "-m", "aot", "run", str(art), "--steps", str(steps), "--metrics", str(metrics), "--quiet", "--timeout", "120"),
                tmp / f"run.{tag}.{attempt}.log",
            )
        except RuntimeError as e:  # a launch that failed counts as a used attempt, and is reported
            print(f"{tag}: launch {attempt + 1} FAILED: {str(e).splitlines()[0]}", file=sys.stderr)
            FAILED_LAUNCHES.append({"tag": tag, "attempt": attempt, "error": str(e)[-2000:]})
            continue
        times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines() if line.strip()]
        result = {"step_s": statistics.median(times[WARMUP_STEPS:]), "other_load_cores": other, "attempts": attempt + 1, "steps": len(times)}
        if best is None or (other or 0) < (best["other_load_cores"] or 0):
            best = result
        if other is not None and other <= max_load:
            break
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="Measure each launch for about this long (steps = seconds / "
        "the plan's predicted step time, at least --steps): 40 steps of a millisecond see 40 ms of a machine "
        "whose speed moves from one second to the next.",
    )
    ap.add_argument("--steps", type=int, default=40, help="The fewest steps a launch runs (the first 5 are warm-up).")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["examples/mlp.py", "examples/gpt.py"])
    ap.add_argument("--profile", type=Path, help="A calibrated profile (default: calibrate before every round and after the last).")
    ap.add_argument("--max-candidates", type=int, default=6, help="Measure at most this many candidates per model (best first, then the worst).")
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--max-other-load", type=float, default=0.5, help="Cores of foreign CPU load above which a run is relaunched.")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-snapshot", action="store_true", help="Run the working tree, not a copy of it taken at the start.")
    args = ap.parse_args()

    results = {
        "world": args.world,
        "seconds": args.seconds,
        "min_steps": args.steps,
        "repeats": args.repeats,
        "batch_size": args.batch_size,
        "nproc": os.cpu_count(),
        "calibrations": [],
        "models": {},
    }
    global CODE
    with tempfile.TemporaryDirectory(prefix="aot-plan-accuracy-") as tmpdir:
        tmp = Path(tmpdir)
        if not args.no_snapshot:  # others may edit the working tree while this runs
            CODE = tmp / "code"
            for part in ("aot", "runner", "examples"):
                shutil.copytree(REPO / part, CODE / part, ignore=shutil.ignore_patterns("__pycache__"))
        profiles = [args.profile] if args.profile else []

        def calibrate_and_price() -> Path:
            """One more calibration, and every measured plan priced by it."""
            profile = tmp / f"cpu-calibrated.{len(profiles)}.json"
            results["calibrations"].append(calibrate(args.world, profile, args.max_other_load, tmp))
            profiles.append(profile)
            for model in args.models:
                name = Path(model).stem
                if name not in results["models"]:
                    continue  # the first calibration: the candidates are chosen from its plan
                plans = plan_model(model, profile, args, tmp / f"plan.{name}.{len(profiles)}.json")["plans"]
                by_plan = {(p["strategy"], p["bucket_mb"]): p["step_s"] for p in plans}
                for c in results["models"][name]["candidates"]:
                    c["prices_s"].append(by_plan.get((c["strategy"], c["bucket_mb"])))
            return profile

        first = profiles[0] if profiles else calibrate_and_price()
        if args.profile:
            results["profile"] = json.loads(Path(first).read_text())
        for model in args.models:
            results["models"][Path(model).stem] = build_candidates(model, first, args, tmp)
        candidates = [(name, c) for name, m in results["models"].items() for c in m["candidates"]]
        for r in range(args.repeats):
            if r > 0 and not args.profile:  # between rounds: each launch is priced by the calibrations around its round
                calibrate_and_price()
            order = candidates[r % len(candidates) :] + candidates[: r % len(candidates)]
            for name, c in order:
                tag = f"{c['artifact'].name}.{r}"
                run_result = measure(c["artifact"], args.world, c["steps"], tmp, tag, args.attempts, args.max_other_load)
                if run_result is None:  # every attempt failed: reported with the results
                    continue
                c["runs"].append({**run_result, "round": r})
                print(
                    f"{name} {c['strategy']} bucket {c['bucket_mb']:g}: {run_result['step_s'] * 1e3:.2f} ms over "
                    f"{run_result['steps']} steps (foreign load {run_result['other_load_cores'] or 0:.2f})",
                    file=sys.stderr,
                )
        if not args.profile:
            calibrate_and_price()
        for m in results["models"].values():
            summarize(m, bracketed=not args.profile)
    results["failed_launches"] = FAILED_LAUNCHES
    print_table(results)
    for f in FAILED_LAUNCHES:
        print(f"failed launch: {f['tag']} attempt {f['attempt'] + 1}: {f['error'].splitlines()[0]}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")


def build_candidates(model: str, profile: Path, args, tmp: Path) -> dict:
    """`aot plan` on `profile`, then an artifact for each plan measured (the best --max-candidates - 1
    and the worst) and one for `--strategy auto`."""
    name = Path(model).stem
    plan = plan_model(model, profile, args, tmp / f"plan.{name}.json")
    plans = plan["plans"]
    chosen = plans[: args.max_candidates - 1] + ([plans[-1]] if len(plans) >= args.max_candidates else [])
    candidates = []
    for i, p in enumerate(chosen):
        steps = WARMUP_STEPS + max(args.steps - WARMUP_STEPS, math.ceil(args.seconds / p["step_s"]))
        art = tmp / f"{name}.{i}"
        run(
            aot(
                "build",
                model,
                "--topology",
                str(profile),
                "--world-size",
                str(args.world),
                "--strategy",
                p["strategy"],
                "--bucket-mb",
                repr(p["bucket_mb"]),
                "--batch-size",
                str(args.batch_size),
                "--max-steps",
                str(steps),
                "--no-onnx",
                "--quiet",
                "-o",
                str(art),
            ),
            tmp / f"build.{name}.{i}.log",
        )
        candidates.append(
            {
                "strategy": p["strategy"],
                "bucket_mb": p["bucket_mb"],
                "predicted_step_s": p["step_s"],
                "prices_s": [p["step_s"]],
                "predicted_rank": plans.index(p) + 1,
                "steps": steps,
                "collectives_per_step": p["collectives_per_step"],
                "artifact": art,
                "runs": [],
            }
        )
    auto = tmp / f"{name}.auto"
    run(
        aot(
            "build",
            model,
            "--topology",
            str(profile),
            "--world-size",
            str(args.world),
            "--strategy",
            "auto",
            "--batch-size",
            str(args.batch_size),
            "--no-onnx",
            "--quiet",
            "-o",
            str(auto),
        ),
        tmp / f"build.{name}.auto.log",
    )
    auto_plan = json.loads((auto / "manifest.json").read_text()).get("plan", {})
    return {
        "parameters": plan["parameters"],
        "plan_seconds": plan["seconds"],
        "candidates": candidates,
        "auto_build": {
            "strategy": auto_plan.get("strategy"),
            "bucket_mb": auto_plan.get("bucket_mb"),
            "predicted_step_s": (auto_plan.get("predicted") or {}).get("step_s"),
        },
    }


def summarize(m: dict, bracketed: bool) -> None:
    """Measured: the median over a plan's launches. Predicted: the first calibration's price.
    Bracketed: the median over its launches of the mean price of the calibrations just before and
    just after the launch's round, so that a machine drifting in the minutes between the first
    calibration and a launch is priced at the speed it had around that launch."""
    candidates = m["candidates"] = [c for c in m["candidates"] if c["runs"]]  # every launch failed: left out
    for c in candidates:
        c["measured_step_s"] = statistics.median(x["step_s"] for x in c["runs"])
        c["other_load_cores"] = statistics.median(x["other_load_cores"] or 0 for x in c["runs"])
        c["error"] = c["predicted_step_s"] / c["measured_step_s"] - 1
        if bracketed and None not in c["prices_s"]:
            c["bracketed_step_s"] = statistics.median((c["prices_s"][x["round"]] + c["prices_s"][x["round"] + 1]) / 2 for x in c["runs"])
            c["bracketed_error"] = c["bracketed_step_s"] / c["measured_step_s"] - 1
        c["artifact"] = str(c["artifact"].name)
    measured_best = min(candidates, key=lambda c: c["measured_step_s"])
    m.update(
        {
            "predicted_best": candidates[0]["strategy"] + f" bucket {candidates[0]['bucket_mb']:g}",
            "measured_best": measured_best["strategy"] + f" bucket {measured_best['bucket_mb']:g}",
            "best_agrees": measured_best is candidates[0],
            **separation(candidates[0], measured_best),
        }
    )
    # near ties flip between calibrations: how many of them price the measured best first
    firsts = [min(candidates, key=lambda c, i=i: c["prices_s"][i] if c["prices_s"][i] is not None else math.inf) for i in range(len(candidates[0]["prices_s"]))]
    m["calibrations_pricing_measured_best_first"] = [sum(f is measured_best for f in firsts), len(firsts)]


def calibrate(world: int, profile: Path, max_load: float, tmp: Path) -> dict:
    """`aot topology calibrate` on `world` ranks into `profile`, once the machine is quiet."""
    wait_for_quiet(max_load, QUIET_PATIENCE)
    other, wall = run(torchrun(world, "-m", "aot", "topology", "calibrate", "--profile", "cpu", "-o", str(profile)), tmp / f"{profile.stem}.log")
    print(f"calibrated in {wall:.1f} s (foreign load {other:.2f} cores)", file=sys.stderr)
    # the whole profile: which of its figures moved between one calibration and the next
    return {
        "seconds": wall,
        "other_load_cores": other,
        "profile": json.loads(profile.read_text()),
        "command": f"torchrun --nproc-per-node {world} -m aot topology calibrate --profile cpu -o cal.json",
    }


def plan_model(model: str, profile: Path, args, out_path: Path) -> dict:
    """`aot plan --json` of `model` on `profile`."""
    with open(out_path, "w") as out:
        subprocess.run(
            aot("plan", model, "--topology", str(profile), "--world-size", str(args.world), "--batch-size", str(args.batch_size), "--json"),
            cwd=CODE,
            env=env(),
            stdout=out,
            check=True,
        )
    return json.loads(out_path.read_text())


def separation(predicted: dict, measured: dict) -> dict:
    """How far the plan predicted best measured behind the one measured best (its median over the
    other's), and whether their launches overlap: the slowest launch of each slower than the
    fastest of the other, so that these launches cannot tell the two apart."""
    if predicted is measured:
        return {"best_margin": 0.0, "best_launches_overlap": False}
    p, m = [x["step_s"] for x in predicted["runs"]], [x["step_s"] for x in measured["runs"]]
    return {"best_margin": predicted["measured_step_s"] / measured["measured_step_s"] - 1, "best_launches_overlap": min(p) <= max(m) and min(m) <= max(p)}


def print_table(results: dict) -> None:
    print("| model | plan | predicted rank | steps | predicted ms | measured ms (launches) | error | bracketed ms | bracketed error | foreign load (cores) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, m in results["models"].items():
        for c in m["candidates"]:
            launches = ", ".join(f"{x['step_s'] * 1e3:.2f}" for x in c["runs"])
            bracketed = f"{c['bracketed_step_s'] * 1e3:.2f} | {c['bracketed_error']:+.0%}" if "bracketed_step_s" in c else "- | -"
            print(
                f"| {name} | {c['strategy']}, bucket {c['bucket_mb']:g} MiB | {c['predicted_rank']} | {c['steps']} | "
                f"{c['predicted_step_s'] * 1e3:.2f} | {c['measured_step_s'] * 1e3:.2f} ({launches}) | {c['error']:+.0%} | "
                f"{bracketed} | {c['other_load_cores']:.2f} |"
            )
    within = [abs(c["error"]) <= 0.2 for m in results["models"].values() for c in m["candidates"]]
    print(f"within +-20%: {sum(within)} of {len(within)} on the first calibration", end="")
    bracketed = [abs(c["bracketed_error"]) <= 0.2 for m in results["models"].values() for c in m["candidates"] if "bracketed_error" in c]
    print(f", {sum(bracketed)} of {len(bracketed)} bracketed" if bracketed else "")
    if bracketed:
        print(
            f"bracketed: each launch priced by the mean of the calibrations taken just before and just after its round "
            f"({len(results['calibrations'])} calibrations), the median over the plan's launches"
        )
    for name, m in results["models"].items():
        verdict = "agree" if m["best_agrees"] else f"DISAGREE: the predicted best measured {m['best_margin']:+.1%} behind"
        if m.get("best_launches_overlap"):
            verdict += ", their launches overlapping"
        agree, total = m["calibrations_pricing_measured_best_first"]
        print(
            f"{name}: predicted best {m['predicted_best']}, measured best {m['measured_best']} ({verdict}); "
            f"{agree} of {total} calibrations price the measured best first; "
            f"--strategy auto built {m['auto_build']['strategy']} bucket {m['auto_build']['bucket_mb']}"
        )


if __name__ == "__main__":
    main()
