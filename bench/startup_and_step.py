"""Benchmark: start-up to the end of step 1, and steady-state step time, aot vs eager vs compiled DDP.

    python bench/startup_and_step.py [--steps 30] [--repeats 3] [--out results.json]
    python bench/startup_and_step.py --model bench/models/gpt2_124m.py --batch-size 1 --no-onnx \
        --variants aot_cli,aot_cli_init_from,ddp_eager --steps 3      # cold start of GPT-2 124M

On this machine's CPUs, 2 ranks with gloo (torchrun --standalone --nproc-per-node 2), the GPT of
examples/gpt.py (or --model), 8 samples per rank, the data of examples/prepare_data.py (for another
model file: `--data-rows` rows of its own batch(), so the shapes match what it was built for). One
invocation runs every variant, interleaved and in a rotating order, `--repeats` times, so the ratios
compare runs that saw the same machine load. Variants:

    aot               bench/aot_worker.py: runner.execution.trainer.Trainer on an artifact built once by
                      `aot build` (build time reported apart), stepped exactly as `aot run` does,
                      the portable tier (the program rebuilt as an FX graph from its JSON)
    aot, compiled     the same artifact's AOTInductor package (`aot run --tier compiled`); with
      tier            this variant the one build is `aot build --compile aoti`
    aot run (CLI)     `torchrun -m aot run ... --tier portable --metrics M` itself; its start-up is
                      when this script sees the first metrics line (polled every 5 ms)
    aot run           the same with `--init-from W`: W is a safetensors file of
      --init-from     `torch.manual_seed(0); model().state_dict()` (tied weights stored under both
                      names), written once before the runs, so the run starts from exactly the
                      weights the init program makes
    eager DDP         bench/ddp_worker.py: DistributedDataParallel, the model file's AdamW,
                      scheduler and clip_grad_norm_
    compiled DDP      bench/ddp_worker.py --compile: torch.compile(DDP(model)), with a fresh
      (cold cache)    TORCHINDUCTOR_CACHE_DIR per run
    compiled DDP      the same with an inductor cache primed once before the repeats
      (warm cache)

Start-up is wall time from BENCH_T0 (time.time() just before the torchrun subprocess is started)
to the end of step 1 on rank 0, so torchrun's and the interpreter's start are counted alike for
every variant; for aot it includes making the weights (replaying the artifact's init program, or
reading --init-from). Steady-state step time is the median of steps 6..N (rank 0); with --steps 5
or fewer only start-up is measured. Every child gets
OMP_NUM_THREADS=1. All files live in one temporary folder that is removed at the end. The code
under test (aot/, runner/, examples/ and the two bench workers) is copied there at the start and
every child runs that copy, so edits made to the working tree during a run cannot mix versions.

The machine may be shared: during every run the script measures how many cores' worth of CPU
*other* processes used (/proc/stat minus this script's own children). A run disturbed by more than
--max-other-load cores is launched again, up to --attempts times, and the least disturbed launch
is kept; the table shows the foreign load the kept runs saw, and medians as well as bests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE = REPO  # where children import aot/runner from: a snapshot of REPO unless --no-snapshot
SNAPSHOT = ("aot", "runner", "examples", "bench/models", "bench/aot_worker.py", "bench/ddp_worker.py")
WARMUP_STEPS = 5  # steady state = steps 6..N

VARIANTS = {
    "aot": "aot (runner.Trainer)",
    "aot_compiled": "aot, compiled tier",
    "aot_cli": "aot run (CLI)",
    "aot_cli_init_from": "aot run --init-from",
    "ddp_eager": "eager DDP",
    "ddp_compile_cold": "compiled DDP, cold cache",
    "ddp_compile_warm": "compiled DDP, warm cache",
}


# -- processes ----------------------------------------------------------------------------
def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # torchrun's default, pinned so every variant gets the same
    env["PYTHONPATH"] = os.pathsep.join([str(CODE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("AOT_DEBUG", None)
    env.update(extra or {})
    return env


def torchrun(world: int) -> list[str]:
    # `python -m torch.distributed.run` is the `torchrun` console script, run by this interpreter.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]


class Failed(Exception):
    def __init__(self, cmd: list[str], rc, log: Path):
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        super().__init__(f"exit {rc}: {shlex.join(cmd)}\n{tail}")
        self.cmd, self.rc, self.tail = shlex.join(cmd), rc, tail


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all cores, /proc/stat), or None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def own_cpu_s() -> float:
    """CPU seconds used by this process and every child it has waited for (and theirs)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


class Load:
    """How many cores' worth of CPU *other* processes used while a run was going: the noise gauge."""

    def __enter__(self):
        self.t, self.busy, self.own = time.time(), busy_cpu_s(), own_cpu_s()
        return self

    def __exit__(self, *exc):
        wall = time.time() - self.t
        busy = busy_cpu_s()
        self.other_cores = None if busy is None or self.busy is None or wall <= 0 else max(0.0, (busy - self.busy) - (own_cpu_s() - self.own)) / wall


def run_child(cmd: list[str], env: dict, log: Path, timeout: float, poll_file: Path | None = None):
    """Run cmd in its own session; return (launch time, time poll_file first became non-empty, Load)."""
    with open(log, "w") as out, Load() as load:
        t0 = time.time()
        env = dict(env, BENCH_T0=repr(t0))
        proc = subprocess.Popen(cmd, cwd=CODE, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        seen = None
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.005 if poll_file is not None and seen is None else 0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if seen is None and poll_file is not None and poll_file.exists() and poll_file.stat().st_size > 0:
                    seen = time.time()
                if time.time() - t0 > timeout:
                    raise Failed(cmd, f"timeout after {timeout:.0f} s", log)
        finally:
            if proc.poll() is None:  # timeout or Ctrl-C: end the torchrun we started and its ranks
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    if rc != 0:
        raise Failed(cmd, rc, log)
    return t0, seen, load


def run_variant(name: str, ctx: dict, tmp: Path, tag: str) -> dict:
    """One torchrun launch of one variant; `tag` names its files (fresh for every attempt)."""
    world, steps, batch = ctx["world"], ctx["steps"], ctx["batch"]
    result_file = tmp / f"{name}.{tag}.json"
    log = tmp / f"{name}.{tag}.log"
    env = child_env({"BENCH_RESULT": str(result_file)})
    if name in ("aot", "aot_compiled"):
        cmd = torchrun(world) + [
            str(CODE / "bench" / "aot_worker.py"),
            ctx["artifact"],
            ctx["data"],
            "--steps",
            str(steps),
            "--tier",
            "compiled" if name == "aot_compiled" else "portable",
        ]
    elif name in ("aot_cli", "aot_cli_init_from"):
        metrics = tmp / f"metrics.{name}.{tag}.jsonl"  # a fresh file: `aot run --metrics` appends
        cmd = torchrun(world) + [
            "-m",
            "aot",
            "run",
            ctx["artifact"],
            "--steps",
            str(steps),
            "--data",
            ctx["data"],
            "--metrics",
            str(metrics),
            "--quiet",
            "--tier",
            "portable",
            *(["--init-from", ctx["init_from"]] if name == "aot_cli_init_from" else []),
        ]
        t0, seen, load = run_child(cmd, env, log, ctx["timeout"], poll_file=metrics)
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return {
            "variant": name,
            "command": shlex.join(cmd),
            "other_load_cores": load.other_cores,
            "launch_to_step1_end_s": (seen - t0) if seen else None,
            # runner-reported: from `import runner.commands.cli` to the end of step 1 (no torchrun, interpreter or torch import)
            "runner_time_since_start_step1_s": records[0]["time_since_start_s"] if records else None,
            "first_step_s": records[0]["step_time_s"] if records else None,
            "step_times_s": [r["step_time_s"] for r in records],
            "losses": [r["loss"] for r in records],
        }
    else:
        cmd = torchrun(world) + [str(CODE / "bench" / "ddp_worker.py"), ctx["model"], ctx["data"], "--steps", str(steps), "--batch-size", str(batch)]
        if name.startswith("ddp_compile"):
            cmd.append("--compile")
            cache = tmp / (f"inductor-cold-{tag}" if name == "ddp_compile_cold" else "inductor-warm")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    _, _, load = run_child(cmd, env, log, ctx["timeout"])
    result = json.loads(result_file.read_text())
    result.update(variant=name, command=shlex.join(cmd), other_load_cores=load.other_cores)
    return result


# -- statistics ---------------------------------------------------------------------------
def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def pre_step(run: dict):
    """Launch to the start of step 1 (start-up minus step 1): everything before the first step,
    the part that differs by design between the variants (for `aot run`, the only split there is)."""
    end, step = run.get("launch_to_step1_end_s"), run.get("first_step_s")
    return end - step if end is not None and step is not None else None


def steady_cpu(run: dict):
    tail = run.get("step_cpu_s", [])[WARMUP_STEPS:]
    return statistics.median(tail) if tail else None


def minimum(values):
    values = [v for v in values if v is not None]
    return min(values) if values else None


def steady(run: dict):
    tail = run.get("step_times_s", [])[WARMUP_STEPS:]
    return statistics.median(tail) if tail else None


WRITE_MODEL_FILES = """
import importlib.util, sys
import torch
from safetensors.torch import save_file
path, what, out, arg = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("bench_user_model", path)
user = importlib.util.module_from_spec(spec)
spec.loader.exec_module(user)
if what == "data":  # the model file's batch(): inputs (or inputs.0, ...) and targets, one sample per row
    inputs, targets = user.batch(int(arg))
    named = {"inputs": inputs} if isinstance(inputs, torch.Tensor) else {f"inputs.{i}": t for i, t in enumerate(inputs)}
    named["targets"] = targets
else:  # weights: torch.manual_seed(seed); model().state_dict(), tied tensors cloned so save_file takes them
    torch.manual_seed(int(arg))
    named = user.model().state_dict()
named = {k: v.detach().clone().contiguous() for k, v in named.items()}
save_file(named, out)
"""


def write_model_files(model: str, env: dict, data: Path | None = None, rows: int = 0, weights: Path | None = None, seed: int = 0) -> None:
    """Write a data file from the model file's batch(rows), or its seeded initial weights, in a child
    process (this one stays free of the model's memory)."""
    what, out, arg = ("data", data, rows) if data is not None else ("weights", weights, seed)
    done = subprocess.run([sys.executable, "-c", WRITE_MODEL_FILES, model, what, str(out), str(arg)], cwd=CODE, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"writing the {what} file from {model} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def snapshot(dest: Path) -> Path:
    """Copy the code under test, so edits others make to the working tree mid-run cannot mix
    two versions of aot/runner into one comparison."""
    for rel in SNAPSHOT:
        src, dst = REPO / rel, dest / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest)], check=False, capture_output=True)
    return dest


def code_digest(root: Path) -> str:
    """sha256 over the .py files of aot/ and runner/ that the children run."""
    h = hashlib.sha256()
    for pkg in ("aot", "runner"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def machine() -> dict:
    info = {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info["cpu_model"] = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), None)
    except (OSError, subprocess.SubprocessError):
        info["cpu_model"] = None
    try:  # the code measured: other people may be editing the working tree
        git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout  # noqa: E731
        info["git_commit"] = git("rev-parse", "--short", "HEAD").strip()
        info["git_dirty_paths"] = [l[3:] for l in git("status", "--porcelain", "--", "aot", "runner").splitlines()]
    except (OSError, subprocess.SubprocessError):
        pass
    import torch

    info["torch"] = torch.__version__
    info["gpu"] = torch.cuda.is_available()
    return info


def fmt(value, scale=1.0, digits=2):
    return "—" if value is None else f"{value * scale:.{digits}f}"


def summarize(runs: dict, ctx: dict) -> dict:
    G = ctx["batch"] * ctx["world"]
    rows = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        row = {
            "runs": len(ok),
            "failed": len(rs) - len(ok),
            "startup_s": median(r.get("launch_to_step1_end_s") for r in ok),
            "startup_best_s": minimum(r.get("launch_to_step1_end_s") for r in ok),
            "startup_all_s": [r.get("launch_to_step1_end_s") for r in ok],
            "pre_step_s": median(pre_step(r) for r in ok),  # launch -> start of step 1
            "pre_step_best_s": minimum(pre_step(r) for r in ok),
            "launch_to_process_s": median(r.get("launch_to_process_s") for r in ok),
            "import_torch_s": median(r.get("import_torch_s") for r in ok),
            "setup_s": median(r.get("setup_s") for r in ok),
            "first_step_s": median(r.get("first_step_s") for r in ok),
            "steady_step_s": median(steady(r) for r in ok),
            "steady_step_best_s": minimum(steady(r) for r in ok),
            "steady_cpu_s": median(steady_cpu(r) for r in ok),
            "steady_cpu_best_s": minimum(steady_cpu(r) for r in ok),
            "other_load_cores": median(r.get("other_load_cores") for r in ok),
            "other_load_max_cores": max((r["other_load_cores"] for r in ok if r.get("other_load_cores") is not None), default=None),
            "launches": sum(len(r.get("attempts", [])) for r in rs),
            "steady_step_all_s": [steady(r) for r in ok],
        }
        if name in ("aot", "aot_compiled"):
            row["load_artifact_s"] = median(r.get("load_artifact_s") for r in ok)
        if name in ("aot_cli", "aot_cli_init_from"):
            row["runner_time_since_start_step1_s"] = median(r.get("runner_time_since_start_step1_s") for r in ok)
        row["samples_per_s"] = G / row["steady_step_s"] if row["steady_step_s"] else None
        if name.startswith("aot"):
            row["collectives_per_step"] = ctx["aot_collectives_per_step"]
        elif ok:
            row["collectives_per_step"] = ok[0].get("parameter_tensors")
            row["ddp_buckets"] = ok[0].get("ddp_buckets")
        rows[name] = row
    return rows


def paired_ratios(runs: dict, a: str, b: str, key) -> list[float]:
    """Per-repeat ratios a/b (runs of one repeat ran back to back, so they share the machine's load)."""
    out = []
    for ra, rb in zip(runs.get(a, []), runs.get(b, [])):
        va, vb = key(ra), key(rb)
        if va is not None and vb:
            out.append(va / vb)
    return out


def ratio(rows, a, b, key):
    va, vb = rows.get(a, {}).get(key), rows.get(b, {}).get(key)
    return va / vb if va is not None and vb else None


def loss_check(runs: dict) -> dict:
    ref = next((r for r in runs.get("ddp_eager", []) if "error" not in r), None)
    out = {}
    if ref is None:
        return out
    for name, rs in runs.items():
        r = next((r for r in rs if "error" not in r), None)
        if r is None or name == "ddp_eager":
            continue
        pairs = list(zip(r.get("losses", []), ref["losses"]))
        out[name] = max((abs(x - y) for x, y in pairs), default=None)
    return out


def quiet(runs: dict, limit: float) -> dict:
    """Medians over every launch (kept or not) during which other processes used ≤ limit cores."""
    out = {}
    for name, rs in runs.items():
        launches = [a for r in rs for a in r.get("attempts", []) if a.get("other_load_cores") is not None and a["other_load_cores"] <= limit]
        out[name] = {
            "launches": len(launches),
            "startup_s": median(a.get("startup_s") for a in launches),
            "steady_step_s": median(a.get("steady_step_s") for a in launches),
        }
    return out


def render(rows: dict, ctx: dict, ratios: dict, losses: dict, calm: dict | None = None) -> str:
    lines = [
        f"{ctx['world']} ranks (gloo, CPU), {Path(ctx['model']).name}, batch {ctx['batch']} per rank, "
        f"{ctx['steps']} steps, {ctx['repeats']} interleaved repeat(s), medians; data: {ctx.get('data_source')}; "
        f"aot build (once, not in start-up): {ctx['build_wall_s']:.1f} s wall "
        f"({ctx['build_reported_s']:.1f} s reported by `aot build`)",
        "",
        "| variant | start-up to end of step 1, s: median (best) | launch → step 1 start | launch → Python | import torch | set-up | step 1 | "
        "steady step, ms: median (best) | CPU per steady step, ms | samples/s | collectives/step | other processes' CPU, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, row in rows.items():
        coll = row.get("collectives_per_step")
        if name.startswith("ddp"):
            coll = f"{coll} params (per-param baseline); DDP used {row.get('ddp_buckets')} bucket(s)" if coll else "—"
        lines.append(
            f"| {VARIANTS[name]} | {fmt(row['startup_s'])} ({fmt(row['startup_best_s'])}) | {fmt(row['pre_step_s'])} | "
            f"{fmt(row['launch_to_process_s'])} | "
            f"{fmt(row['import_torch_s'])} | {fmt(row['setup_s'])} | {fmt(row['first_step_s'])} | "
            f"{fmt(row['steady_step_s'], 1e3, 1)} ({fmt(row['steady_step_best_s'], 1e3, 1)}) | {fmt(row['steady_cpu_s'], 1e3, 1)} | "
            f"{fmt(row['samples_per_s'], digits=0)} | {coll if coll is not None else '—'} | {fmt(row['other_load_cores'])} |"
        )
    lines.append("")
    lines.append(
        f"Launches (each run is re-launched, up to {ctx['attempts']} times, while other processes use more than "
        f"{ctx['max_other_load']} cores, and the least disturbed launch is kept): "
        + ", ".join(f"{VARIANTS[n]} {r['launches']} for {r['runs']} runs (kept: ≤ {fmt(r['other_load_max_cores'])} cores)" for n, r in rows.items())
    )
    if ctx.get("init_from_bytes"):
        lines.append(
            f"--init-from file: {ctx['init_from_bytes'] / 2**20:.0f} MiB safetensors of torch.manual_seed(0); "
            f"model().state_dict(), written once before the runs (so it is in the page cache)"
        )
    if "aot" in rows and rows["aot"].get("load_artifact_s") is not None:
        lines.append(f"aot set-up: {rows['aot']['load_artifact_s']:.2f} s of it in runner import + Trainer() (verify, deserialize program, process group)")
    for name in ("aot_cli", "aot_cli_init_from"):
        if rows.get(name, {}).get("runner_time_since_start_step1_s") is not None:
            since = rows[name]["runner_time_since_start_step1_s"]
            lines.append(f"{VARIANTS[name]}: its own metrics say step 1 ended {since:.2f} s after `import runner.commands.cli` (median)")
    lines.append("")
    lines.append("| ratio | of medians | of bests | per repeat (paired) | goal | met? |")
    lines.append("|---|---:|---:|---|---:|---|")
    for label, (value, best, per, goal) in ratios.items():
        met = "—" if value is None or goal is None else ("yes" if value <= goal else "NO")
        if met != "—" and best is not None and (best <= goal) != (value <= goal):
            met = "unclear (median and best disagree)"
        lines.append(
            f"| {label} | {fmt(value, digits=3)} | {fmt(best, digits=3)} | {', '.join(f'{p:.3f}' for p in per) or '—'} | "
            f"{'≤ ' + str(goal) if goal is not None else '—'} | {met} |"
        )
    if calm:
        lines.append("")
        lines.append(
            f"Only the launches during which other processes used ≤ {ctx['max_other_load']} cores "
            f"(kept or not; fewer runs, so a cross-check rather than the result):"
        )
        lines.append("")
        lines.append("| variant | such launches | start-up, s (median) | steady step, ms (median) |")
        lines.append("|---|---:|---:|---:|")
        for name, q in calm.items():
            lines.append(f"| {VARIANTS[name]} | {q['launches']} | {fmt(q['startup_s'])} | {fmt(q['steady_step_s'], 1e3, 1)} |")
        for label, a, b, key, goal in (
            ("aot start-up / compiled DDP (cold cache) start-up", "aot", "ddp_compile_cold", "startup_s", 0.1),
            ("aot steady step / eager DDP steady step", "aot", "ddp_eager", "steady_step_s", 1.0),
            ("aot run (CLI) start-up / eager DDP start-up", "aot_cli", "ddp_eager", "startup_s", 1.0),
            ("aot run --init-from start-up / eager DDP start-up", "aot_cli_init_from", "ddp_eager", "startup_s", 1.0),
        ):
            value = ratio(calm, a, b, key)
            if value is not None:
                lines.append(f"- undisturbed launches only: {label} = {value:.3f} (goal ≤ {goal}: {'met' if value <= goal else 'not met'})")
    if losses:
        lines.append("")
        lines.append("max |loss − eager DDP loss| over all steps: " + ", ".join(f"{VARIANTS[k]} {v:.2e}" for k, v in losses.items() if v is not None))
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every variant (default: %(default)s)")
    p.add_argument("--out", type=Path, help="write every run and the summary to this JSON file")
    p.add_argument("--model", type=Path, default=REPO / "examples" / "gpt.py")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (default: %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    p.add_argument(
        "--max-other-load", type=float, default=0.25, help="re-launch a run during which other processes used more than this many cores (default: %(default)s)"
    )
    p.add_argument("--attempts", type=int, default=2, help="launches at most per variant and repeat; the least disturbed is kept (default: %(default)s)")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false", help="run aot/runner from the working tree instead of a copy taken at start")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per run (default: %(default)s)")
    p.add_argument(
        "--data-rows",
        type=int,
        default=None,
        help="rows of the data file made from the model file's batch() when --model is not examples/gpt.py "
        "(default: batch size x world size x steps, one fresh row per sample)",
    )
    p.add_argument("--no-onnx", action="store_true", help="build with `aot build --no-onnx` (training never reads the export; it only lengthens the build)")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.steps <= WARMUP_STEPS:
        print(
            f"note: --steps {args.steps} <= {WARMUP_STEPS}: start-up only, no steady-state step time (steady state is steps {WARMUP_STEPS + 1}..N)",
            file=sys.stderr,
        )

    ctx = {
        "world": args.world_size,
        "steps": args.steps,
        "batch": args.batch_size,
        "repeats": args.repeats,
        "model": str(args.model.resolve()),
        "timeout": args.timeout,
        "attempts": args.attempts,
        "max_other_load": args.max_other_load,
        "machine": machine(),
    }
    m = ctx["machine"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    failures, lost = [], []
    global CODE
    with tempfile.TemporaryDirectory(prefix="aot-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if args.snapshot:
            CODE = snapshot(tmp / "code")
            model = Path(ctx["model"])
            if model.is_relative_to(REPO):
                ctx["model"] = str(CODE / model.relative_to(REPO))
        ctx["machine"]["code_sha256"] = code_digest(CODE)
        print(
            f"machine: {m['nproc']} CPUs ({m['cpu_model']}), torch {m['torch']}, GPU: {m['gpu']}; code: commit "
            f"{m.get('git_commit')} with {len(m.get('git_dirty_paths', []))} uncommitted path(s) under aot/ and runner/, "
            f"{'snapshot' if args.snapshot else 'working tree'} sha256 {m['code_sha256']}",
            file=sys.stderr,
        )
        env = child_env()
        data = tmp / "data.safetensors"
        if Path(ctx["model"]).resolve() == (CODE / "examples" / "gpt.py").resolve():
            subprocess.run([sys.executable, str(CODE / "examples" / "prepare_data.py"), "-o", str(data)], cwd=CODE, env=env, check=True, capture_output=True)
            ctx["data_source"] = "examples/prepare_data.py (512 windows)"
        else:  # the model file's own batch(), so the data matches the shapes it is built for
            rows = args.data_rows or args.batch_size * args.world_size * args.steps
            write_model_files(ctx["model"], env, data=data, rows=rows)
            ctx["data_source"] = f"{Path(ctx['model']).name}'s batch({rows})"
        if "aot_cli_init_from" in variants:
            weights = tmp / "init_from.safetensors"
            t = time.perf_counter()
            write_model_files(ctx["model"], env, weights=weights, seed=0)
            ctx.update(init_from=str(weights), init_from_bytes=weights.stat().st_size, init_from_write_s=time.perf_counter() - t)
            print(
                f"--init-from weights: {weights.stat().st_size / 2**20:.0f} MiB "
                f"(torch.manual_seed(0); model().state_dict()), written in {ctx['init_from_write_s']:.1f} s",
                file=sys.stderr,
            )
        artifact = tmp / "artifact"
        build_cmd = [
            sys.executable,
            "-m",
            "aot",
            "build",
            ctx["model"],
            "--world-size",
            str(args.world_size),
            "--batch-size",
            str(args.batch_size),
            "-o",
            str(artifact),
            "--json",
            *(["--compile", "aoti"] if "aot_compiled" in variants else []),
            *(["--no-onnx"] if args.no_onnx else []),
        ]
        t = time.perf_counter()
        built = subprocess.run(build_cmd, cwd=CODE, env=env, capture_output=True, text=True)
        ctx["build_wall_s"] = time.perf_counter() - t
        if built.returncode != 0:
            print(f"aot build failed (exit {built.returncode}): {shlex.join(build_cmd)}\n{built.stderr[-3000:]}", file=sys.stderr)
            return 1
        summary = json.loads(built.stdout)
        ctx["build_reported_s"] = summary["seconds"]
        ctx["build_command"] = shlex.join(build_cmd)
        ctx["aot_collectives_per_step"] = summary.get("collectives_per_step")
        if ctx["aot_collectives_per_step"] is None:  # older `aot build --json`: ask `aot inspect`
            inspected = subprocess.run([sys.executable, "-m", "aot", "inspect", str(artifact), "--json"], cwd=CODE, env=env, capture_output=True, text=True)
            if inspected.returncode == 0:
                ctx["aot_collectives_per_step"] = json.loads(inspected.stdout)["programs"]["train"]["collectives_per_step"]
            else:
                print(f"warning: aot inspect failed, collectives per step unknown: {inspected.stderr.strip()[-300:]}", file=sys.stderr)
        ctx.update(artifact=str(artifact), data=str(data))
        print(f"aot build: {ctx['build_wall_s']:.1f} s wall, {ctx['aot_collectives_per_step']} collective(s) per step", file=sys.stderr)

        if "ddp_compile_warm" in variants:  # prime the warm inductor cache once, unmeasured
            print("priming the inductor cache for 'compiled DDP, warm cache' ...", file=sys.stderr)
            try:
                run_variant("ddp_compile_warm", dict(ctx, steps=WARMUP_STEPS + 1), tmp, "prime")
            except Failed as e:
                failures.append({"variant": "ddp_compile_warm (priming)", "error": str(e)})

        for rep in range(args.repeats):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]  # rotate the order
            for name in order:
                # Up to --attempts launches; keep the one other processes disturbed least, and stop
                # early once one ran with at most --max-other-load cores of foreign CPU use.
                kept, tried = None, []
                for attempt in range(args.attempts):
                    try:
                        r = run_variant(name, ctx, tmp, f"{rep}.{attempt}")
                    except Failed as e:
                        failures.append({"variant": name, "repeat": rep, "attempt": attempt, "error": str(e), "command": e.cmd})
                        print(f"repeat {rep + 1}/{args.repeats}  {VARIANTS[name]} FAILED (attempt {attempt + 1}): {e}", file=sys.stderr)
                        continue
                    load = r.get("other_load_cores")
                    print(
                        f"repeat {rep + 1}/{args.repeats}  {VARIANTS[name]:<26} start-up "
                        f"{fmt(r.get('launch_to_step1_end_s'))} s, steady step {fmt(steady(r), 1e3, 1)} ms, "
                        f"other processes {fmt(load)} cores" + (f" (attempt {attempt + 1})" if attempt else ""),
                        file=sys.stderr,
                    )
                    tried.append({"other_load_cores": load, "startup_s": r.get("launch_to_step1_end_s"), "steady_step_s": steady(r)})
                    if kept is None or (load or 0) < (kept.get("other_load_cores") or 0):
                        kept = r
                    if load is None or load <= args.max_other_load:
                        break
                if kept is None:
                    kept = {"variant": name, "error": "every attempt failed"}
                    lost.append((rep, name))
                kept.update(repeat=rep, attempts=tried)
                runs[name].append(kept)
        del ctx["artifact"], ctx["data"]  # gone with the temporary folder
        ctx.pop("init_from", None)

    rows = summarize(runs, ctx)
    startup = lambda r: r.get("launch_to_step1_end_s")  # noqa: E731

    def pair(a, b, what, goal=None):
        key = {"startup": startup, "steady_step": steady, "steady_cpu": steady_cpu, "pre_step": pre_step}[what]
        return (ratio(rows, a, b, f"{what}_s"), ratio(rows, a, b, f"{what}_best_s"), paired_ratios(runs, a, b, key), goal)

    ratios = {
        "aot start-up / compiled DDP (cold cache) start-up": pair("aot", "ddp_compile_cold", "startup", 0.1),
        "aot start-up / compiled DDP (warm cache) start-up": pair("aot", "ddp_compile_warm", "startup"),
        "aot start-up / eager DDP start-up": pair("aot", "ddp_eager", "startup"),
        "aot compiled tier start-up / compiled DDP (cold cache) start-up": pair("aot_compiled", "ddp_compile_cold", "startup", 0.1),
        "aot compiled tier start-up / compiled DDP (warm cache) start-up": pair("aot_compiled", "ddp_compile_warm", "startup"),
        "aot compiled tier steady step / compiled DDP (warm cache) steady step": pair("aot_compiled", "ddp_compile_warm", "steady_step"),
        "aot compiled tier steady step / aot portable steady step": pair("aot_compiled", "aot", "steady_step"),
        "aot steady step / eager DDP steady step": pair("aot", "ddp_eager", "steady_step", 1.0),
        "aot steady step / compiled DDP (cold cache) steady step": pair("aot", "ddp_compile_cold", "steady_step"),
        "aot steady step / compiled DDP (warm cache) steady step": pair("aot", "ddp_compile_warm", "steady_step"),
        "aot run (CLI) start-up (init program) / eager DDP start-up": pair("aot_cli", "ddp_eager", "startup", 1.0),
        "aot run --init-from start-up / eager DDP start-up": pair("aot_cli_init_from", "ddp_eager", "startup", 1.0),
        "aot run (CLI) launch → step 1 start / eager DDP's": pair("aot_cli", "ddp_eager", "pre_step"),
        "aot run --init-from launch → step 1 start / eager DDP's": pair("aot_cli_init_from", "ddp_eager", "pre_step"),
        "aot run (CLI) steady step / eager DDP steady step": pair("aot_cli", "ddp_eager", "steady_step"),
        "aot CPU per step / eager DDP CPU per step (rank 0; less load-sensitive)": pair("aot", "ddp_eager", "steady_cpu"),
    }
    ratios = {k: v for k, v in ratios.items() if v[0] is not None}
    losses = loss_check(runs)
    calm = quiet(runs, args.max_other_load)
    print(render(rows, ctx, ratios, losses, calm))
    if failures:
        print(f"\nFailed launches ({len(failures)}; {len(lost)} repeat(s) left without a result):", file=sys.stderr)
        for f in failures:
            print(f"- {f['variant']} (repeat {f.get('repeat')}, attempt {f.get('attempt')}): {f['error']}", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "context": ctx,
                    "summary": rows,
                    "ratios": {k: {"of_medians": v, "of_bests": best, "per_repeat": per, "goal": goal} for k, (v, best, per, goal) in ratios.items()},
                    "max_loss_diff_vs_eager": losses,
                    "undisturbed_launches": calm,
                    "runs": runs,
                    "failures": failures,
                },
                indent=1,
            )
        )
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
