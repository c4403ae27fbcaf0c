"""Benchmark: the compiled (AOTInductor) tier against the portable tier, side by side.

    python bench/aoti_tier.py [--steps 50] [--repeats 3] [--models gpt,mlp] [--out results.json]

For each model (examples/gpt.py with the data of examples/prepare_data.py, examples/mlp.py on its
example batch) it builds one artifact with `aot build --world-size 2 --no-onnx --compile aoti`
(which holds both tiers; the build's seconds are reported, and a portable-only build's for
comparison), then launches 2 CPU ranks (torchrun --standalone --nproc-per-node 2, gloo,
OMP_NUM_THREADS=1) once per tier per repeat, alternating which tier goes first, each training
--steps steps exactly as `aot run --tier T` does (runner.Trainer, data_source, step). Measured on
rank 0:

    process start -> end of step 1   from the rank process's start (/proc/self/stat, 10 ms
                                     resolution) to the end of step 1: interpreter, import torch,
                                     Trainer (verify, process group, load the program or package),
                                     then step 1
    launch -> end of step 1          the same from just before torchrun is started
    set-up                           Trainer construction alone
    steady step                      median wall time of steps 6..N, and its CPU time (all threads)

plus the largest |loss difference| between the tiers over all steps, and the CPU that other
processes used during each launch (the machine may be shared). The code under test (aot/,
runner/, examples/, this file) is copied to a temporary folder first and every child runs that
copy. In a rank (`--worker`) this file is the worker.
"""

import time

T_TOP = time.time()  # first statement: as close to the rank's process start as Python code gets

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def process_start() -> float:
    """When this process started (time.time() scale), from /proc: its start in clock ticks since
    boot against the uptime now (10 ms resolution); this file's first statement where /proc is not."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return T_TOP


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("--data")
    parser.add_argument("--tier", required=True)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)

    import torch  # noqa: F401

    t_torch = time.time()
    import torch.distributed as dist
    from runner.execution.trainer import Trainer

    trainer = Trainer(args.artifact, None, tier=args.tier)
    t_loaded = time.time()
    trainer.check_steps(args.steps)
    source = trainer.data_source(args.data)
    steps, cpus, losses, t_step1 = [], [], [], None
    for _ in range(args.steps):
        inputs, targets = source.batch(trainer.step_index)
        start, cpu = time.perf_counter(), time.process_time()
        losses.append(trainer.step(inputs, targets))
        steps.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
        t_step1 = t_step1 or time.time()
    if trainer.rank == 0:
        t0 = float(os.environ["BENCH_T0"])
        with open(os.environ["BENCH_RESULT"], "w") as f:
            started = min(process_start(), T_TOP)
            json.dump(
                {
                    "tier": trainer.tier,
                    "loader": trainer.program_loader,
                    "launch_to_process_s": started - t0,
                    "interpreter_s": T_TOP - started,
                    "import_torch_s": t_torch - T_TOP,
                    "setup_s": t_loaded - t_torch,
                    "process_to_step1_end_s": t_step1 - started,
                    "launch_to_step1_end_s": t_step1 - t0,
                    "first_step_s": steps[0],
                    "step_times_s": steps,
                    "step_cpu_s": cpus,
                    "losses": losses,
                },
                f,
            )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2:])
    sys.exit(0)

import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5  # steady state: steps 6..N


def busy_cpu_s() -> float:
    """CPU seconds the machine spent busy since boot (all cores; /proc/stat minus idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(code: Path, cmd: list[str], result: Path, log: Path) -> dict:
    """Run one torchrun; its rank-0 result plus the cores' worth of CPU other processes used."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code), "BENCH_RESULT": str(result)}
    env.pop("AOT_DEBUG", None)
    busy, own, t0 = busy_cpu_s(), children_cpu_s(), time.time()
    env["BENCH_T0"] = repr(t0)
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    other = max(0.0, (busy_cpu_s() - busy) - (children_cpu_s() - own)) / wall
    return {**json.loads(result.read_text()), "other_load_cores": other}


def build(code: Path, model: str, out: Path, compile_tier: str, cache: Path) -> float:
    """`aot build` seconds; AOTInductor compiles into an empty cache, so this is a cold build."""
    cmd = [
        sys.executable,
        "-m",
        "aot",
        "build",
        f"examples/{model}.py",
        "--world-size",
        "2",
        "--no-onnx",
        "--compile",
        compile_tier,
        "-o",
        str(out),
        "--json",
        "--quiet",
    ]
    env = {**os.environ, "PYTHONPATH": str(code), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    r = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"build failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)["seconds"]


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="gpt,mlp")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), None)
    info = {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": model_name or platform.machine(),
        "torch": torch.__version__,
        "gpu": torch.cuda.is_available(),
        "python": platform.python_version(),
    }
    with tempfile.TemporaryDirectory(prefix="aot-bench-aoti-") as tmp:
        tmp = Path(tmp)
        code = tmp / "code"
        for rel in ("aot", "runner", "examples"):
            shutil.copytree(REPO / rel, code / rel, ignore=shutil.ignore_patterns("__pycache__"))
        (code / "bench").mkdir()
        shutil.copy2(__file__, code / "bench" / "aoti_tier.py")
        results = {"machine": info, "steps": args.steps, "repeats": args.repeats, "models": {}}
        for model in args.models.split(","):
            art = tmp / f"{model}-aoti"
            seconds = {
                "portable": build(code, model, tmp / f"{model}-portable", "portable", tmp / "cache-p"),
                "aoti": build(code, model, art, "aoti", tmp / f"inductor-cache-{model}"),
            }
            data = []
            if model == "gpt":
                subprocess.run([sys.executable, "examples/prepare_data.py", "-o", str(tmp / "gpt.safetensors")], cwd=code, check=True, capture_output=True)
                data = ["--data", str(tmp / "gpt.safetensors")]
            runs = {"compiled": [], "portable": []}
            for repeat in range(args.repeats):
                order = ("compiled", "portable") if repeat % 2 == 0 else ("portable", "compiled")
                for tier in order:
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node",
                        "2",
                        "bench/aoti_tier.py",
                        "--worker",
                        str(art),
                        *data,
                        "--tier",
                        tier,
                        "--steps",
                        str(args.steps),
                    ]
                    run = launch(code, cmd, tmp / f"{model}-{tier}-{repeat}.json", tmp / f"{model}-{tier}-{repeat}.log")
                    assert run["tier"] == tier, run["tier"]
                    runs[tier].append(run)
                    print(
                        f"{model} {tier:<9} repeat {repeat + 1}: process start -> step 1 end "
                        f"{run['process_to_step1_end_s']:.2f} s, steady step "
                        f"{med(run['step_times_s'][WARMUP:]) * 1e3:.2f} ms, other load {run['other_load_cores']:.2f} cores",
                        file=sys.stderr,
                    )
            summary = {}
            for tier, rs in runs.items():
                summary[tier] = {
                    "process_to_step1_end_s": med(r["process_to_step1_end_s"] for r in rs),
                    "launch_to_step1_end_s": med(r["launch_to_step1_end_s"] for r in rs),
                    "interpreter_s": med(r["interpreter_s"] for r in rs),
                    "import_torch_s": med(r["import_torch_s"] for r in rs),
                    "setup_s": med(r["setup_s"] for r in rs),
                    "first_step_s": med(r["first_step_s"] for r in rs),
                    "steady_step_s": med(med(r["step_times_s"][WARMUP:]) for r in rs),
                    "steady_step_best_s": min(med(r["step_times_s"][WARMUP:]) for r in rs),
                    "steady_cpu_s": med(med(r["step_cpu_s"][WARMUP:]) for r in rs),
                    "other_load_cores": med(r["other_load_cores"] for r in rs),
                }
            diff = max(abs(a - b) for c, p in zip(runs["compiled"], runs["portable"]) for a, b in zip(c["losses"], p["losses"]))
            results["models"][model] = {"build_s": seconds, "tiers": summary, "max_loss_diff": diff, "runs": runs}
            print(json.dumps({model: {"build_s": seconds, "max_loss_diff": diff, **summary}}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
