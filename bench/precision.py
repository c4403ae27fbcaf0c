"""Benchmark: mixed precision (`--precision fp32|bf16|fp16`), predicted on GPU profiles and measured on CPU ranks.

    python bench/precision.py [--predict gpt:8,gpt:1024,1b:8,1b:1024,8b:8,8b:1024,70b:8,70b:1024]
        [--reduce-bf16 8b:1024] [--rounds 5] [--steps 30] [--no-eager] [--no-kernels] [--max-load 0.3]
        [--out precision.json]

Part 1, predictions. Each case MODEL:WORLD is `aot plan MODEL --topology dgx_a100 --nodes WORLD/8
--world-size WORLD --axes fsdp --batch-size B --precision P --json`, once with P = fp32 and once
with P = bf16 (gradients reduced in fp32, the default), and for the cases named in --reduce-bf16
once more with `--precision bf16 --reduce-dtype bf16`. MODEL is `gpt` (examples/gpt.py, B = 8) or a
preset of examples/llama.py (`1b`, `8b`, `70b`, chosen with AOT_SIZE, sequence 2048; B = 1). The
first (best) plan's predicted step time, peak memory per rank, collective bytes per step and
whether it fits are kept, with the bf16/fp32 ratios. Each `aot plan` runs as a fresh process
with a time limit (--plan-timeout); a case over it is reported as left out.

Part 2, measured. examples/gpt.py is built for `--topology cpu --world-size 2` under dp=2 and
fsdp=2, each with --precision fp32, bf16 and fp16 (`--no-onnx`, batch 8 per rank), and each
artifact is trained with `torchrun --standalone --nproc-per-node 2 -m aot run ART --steps N
--metrics M --quiet`. A launch's step time is the median `step_time_s` of its steps after the
first 5 (rank 0's metrics); the variants are interleaved over --rounds rounds (every variant once
per round, the order reversed every other round) so that load on this shared machine hits them
alike, and a variant's number is the median over rounds. With eager (default on), each round also
runs the eager PyTorch equivalent of each variant under the same torchrun: DistributedDataParallel
(dp) or FSDP2's fully_shard per block and at the root (fsdp, MixedPrecisionPolicy(param_dtype=the
compute dtype, reduce_dtype=fp32)), forward and loss under torch.autocast("cpu"), fp16 with
torch.amp.GradScaler, AdamW, clipping and the scheduler of the model file; it times the same span
(zero_grad to the optimizer and scheduler step) and imports nothing from aot.

Part 3, kernels (--kernels, default on): torch.mm on one thread for gpt.py's matmul shapes in fp32,
bf16 and fp16, the median of 50 calls each: how this CPU's kernels treat each dtype.

Children run a copy of aot/, runner/ and examples/ as committed at HEAD (`git archive`), so the
numbers belong to a commit while others edit the working tree (--no-snapshot: the working tree),
with OMP_NUM_THREADS=1. This machine may be shared: before each plan, build and launch the script
waits (up to 60 s) for a 2-second window in which other processes use at most --max-load cores,
and it records the CPU time they used during each one (cores' worth, as bench/plan_accuracy.py
does). --out writes every number as JSON; stdout gets the tables.
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
WARMUP = 5
MODELS = {
    "gpt": ("examples/gpt.py", None, 8),
    "1b": ("examples/llama.py", "1b", 1),
    "8b": ("examples/llama.py", "8b", 1),
    "70b": ("examples/llama.py", "70b", 1),
}
DEFAULT_PREDICT = "gpt:8,gpt:1024,1b:8,1b:1024,8b:8,8b:1024,70b:8,70b:1024"
MEASURED_STRATEGIES = ("dp=2", "fsdp=2")
MEASURED_PRECISIONS = ("fp32", "bf16", "fp16")


# -- eager worker (run by torchrun: `python bench/precision.py --eager-worker ...`) --------------
def eager_worker(argv: list[str]) -> None:
    """DDP or FSDP2 with torch.autocast on CPU, timed like `aot run` times a step. No aot imports."""
    import importlib.util
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    ap = argparse.ArgumentParser()
    ap.add_argument("model_file")
    ap.add_argument("--strategy", choices=["dp", "fsdp"], required=True)
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    spec = importlib.util.spec_from_file_location("bench_precision_model", a.model_file)
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = user.model()
    if a.strategy == "dp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
        for block in getattr(model, "blocks", getattr(model, "layers", [])):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        net = model
    params = list(model.parameters())
    opt = user.optimizer(params)
    sched = user.scheduler(opt) if hasattr(user, "scheduler") else None
    loss_fn = getattr(user, "loss", None) or (lambda o, t: F.cross_entropy(o.reshape(-1, o.size(-1)), t.reshape(-1)))
    clip = getattr(user, "max_grad_norm", None)
    scaler = torch.amp.GradScaler("cpu", **getattr(user, "grad_scaler", {})) if a.precision == "fp16" else None
    inputs, targets = user.batch(a.batch_size * world)
    x, y = inputs[rank * a.batch_size : (rank + 1) * a.batch_size], targets[rank * a.batch_size : (rank + 1) * a.batch_size]
    times, losses = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(net(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if rank == 0:
        Path(a.result).write_text(json.dumps({"step_time_s": times, "loss": losses}))
    dist.destroy_process_group()


if len(sys.argv) > 1 and sys.argv[1] == "--eager-worker":
    eager_worker(sys.argv[2:])
    sys.exit(0)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import busy_cpu_s, own_cpu_s, wait_for_quiet  # noqa: E402

CODE = REPO  # the tree the children run: HEAD's aot/, runner/, examples/ unless --no-snapshot
QUIET = (0.3, 60.0)  # before each plan and launch: wait up to 60 s for others to use <= 0.3 cores


def env(extra: dict | None = None) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", **(extra or {}))
    e["PYTHONPATH"] = os.pathsep.join([str(CODE)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e.pop("AOT_DEBUG", None)
    return e


def run(cmd: list, log: Path, timeout: float, extra_env: dict | None = None) -> dict:
    """Run cmd to its end (or the time limit); wall seconds, exit code, foreign load in cores.
    Its stdout goes to `log`, its stderr to `log` + ".err"."""
    wait_for_quiet(*QUIET)
    t0, busy0, own0 = time.time(), busy_cpu_s(), own_cpu_s()
    with open(log, "w") as out, open(f"{log}.err", "w") as err:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=CODE, env=env(extra_env), stdout=out, stderr=err, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the process group this call started (torchrun and its ranks)
            proc.wait()
            rc = None
    wall = time.time() - t0
    busy1 = busy_cpu_s()
    foreign = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own_cpu_s() - own0)) / wall
    return {"rc": rc, "wall_s": wall, "foreign_load_cores": None if foreign is None else round(foreign, 2)}


def aot(*args) -> list:
    return [sys.executable, "-m", "aot", *args]


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


# -- part 1: predictions ------------------------------------------------------------------------
def predict(model: str, world: int, precision: str, reduce_dtype: str | None, tmp: Path, timeout: float) -> dict:
    path, size, batch = MODELS[model]
    cmd = aot(
        "plan",
        CODE / path,
        "--topology",
        "dgx_a100",
        "--nodes",
        max(1, world // 8),
        "--world-size",
        world,
        "--axes",
        "fsdp",
        "--batch-size",
        batch,
        "--precision",
        precision,
        "--json",
        *(["--reduce-dtype", reduce_dtype] if reduce_dtype else []),
    )
    tag = f"{model}-{world}-{precision}-{reduce_dtype or 'default'}"
    log = tmp / f"plan.{tag}.out"
    r = run(cmd, log, timeout, {"AOT_SIZE": size} if size else None)
    row = {
        "model": model,
        "world": world,
        "batch_size": batch,
        "precision": precision,
        "reduce_dtype": reduce_dtype or "fp32",
        "plan_wall_s": round(r["wall_s"], 1),
        "foreign_load_cores": r["foreign_load_cores"],
    }
    if r["rc"] is None:
        return {**row, "left_out": f"aot plan ran past {timeout:.0f} s"}
    if r["rc"] != 0:
        return {**row, "error": Path(f"{log}.err").read_text().strip()[-600:]}
    d = json.loads(log.read_text())
    best = d["plans"][0]
    return {
        **row,
        "parameters": d["parameters"],
        "precision_policy": d["precision"],
        "calibrated": d["calibrated"],
        "strategy": best["strategy"],
        "fits": best["fits"],
        "step_s": best["step_s"],
        "compute_s": best["compute_s"],
        "comm_s": best["comm_s"],
        "exposed_comm_s": best["exposed_comm_s"],
        "collectives_per_step": best["collectives_per_step"],
        "collective_bytes_per_step": best["collective_bytes_per_step"],
        "memory_bytes": best["memory_bytes"],
    }


def prediction_table(rows: list[dict]) -> str:
    base = {(r["model"], r["world"]): r for r in rows if r["precision"] == "fp32" and "step_s" in r}
    lines = [
        "| model | ranks | precision | reduce | step s | vs fp32 | compute s | exposed comm s | peak GiB | vs fp32 | "
        "of which transient GiB | params + optimizer GiB | collective GiB/step | vs fp32 | fits | plan s | foreign load |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['world']} | {r['precision']} | {r['reduce_dtype']} |"
        if "step_s" not in r:
            why = r.get("left_out") or "failed: " + r.get("error", "").splitlines()[-1]
            lines.append(f"{head} {why} | | | | | | | | | | | | {r['plan_wall_s']} | {r['foreign_load_cores']} |")
            continue
        b, m = base.get((r["model"], r["world"])), r["memory_bytes"]
        ratio = (lambda f: f"{f(r) / f(b):.2f}") if b else (lambda f: "")
        lines.append(
            f"{head} {r['step_s']:.4g} | {ratio(lambda x: x['step_s'])} | {r['compute_s']:.4g} | {r['exposed_comm_s']:.3g} | "
            f"{m['peak'] / 2**30:.3g} | {ratio(lambda x: x['memory_bytes']['peak'])} | {m['peak_transient'] / 2**30:.3g} | "
            f"{(m['params'] + m['optimizer']) / 2**30:.3g} | {r['collective_bytes_per_step'] / 2**30:.3g} | "
            f"{ratio(lambda x: x['collective_bytes_per_step'])} | {'yes' if r['fits'] else 'NO'} | {r['plan_wall_s']} | "
            f"{r['foreign_load_cores']} |"
        )
    return "\n".join(lines)


# -- part 3: the CPU's matmul kernels per dtype ----------------------------------------------------
KERNEL_SHAPES = ((512, 64, 64), (512, 64, 256), (512, 256, 64), (512, 64, 96))  # gpt.py's matmuls at batch 8: M, K, N


def kernels(reps: int = 50) -> list[dict]:
    """torch.mm on one thread for examples/gpt.py's shapes (q/k/v/proj, fc, mlp proj, lm_head: 8 x 64
    tokens), fp32 vs bf16 vs fp16: what this CPU's kernels do with each dtype."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for m, k, n in KERNEL_SHAPES:
        row = {"m": m, "k": k, "n": n}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            for _ in range(5):
                a @ b
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                a @ b
                times.append(time.perf_counter() - t0)
            row[f"{name}_us"] = round(statistics.median(times) * 1e6, 1)
        rows.append(row)
    return rows


def kernel_table(rows: list[dict]) -> str:
    lines = ["| matmul (M x K) @ (K x N) | fp32 us | bf16 us | vs fp32 | fp16 us | vs fp32 |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| ({r['m']} x {r['k']}) @ ({r['k']} x {r['n']}) | {r['fp32_us']} | {r['bf16_us']} | "
            f"{r['bf16_us'] / r['fp32_us']:.2f} | {r['fp16_us']} | {r['fp16_us'] / r['fp32_us']:.1f} |"
        )
    return "\n".join(lines)


# -- part 2: measured -----------------------------------------------------------------------------
def measured_table(variants: dict) -> str:
    lines = [
        "| strategy | precision | aot run step ms (median of rounds) | rounds min-max | vs fp32 | eager step ms | "
        "rounds min-max | vs fp32 | aot / eager | loss at last step (aot) | foreign load max |",
        "|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for (strategy, precision), v in variants.items():
        base = variants.get((strategy, "fp32"), {})
        row = f"| {strategy} | {precision} |"
        for kind in ("aot", "eager"):
            t = v.get(f"{kind}_ms")
            if not t:
                row += " | | |" if kind == "eager" or not v.get("error") else f" failed: {v['error']} | | |"
                continue
            b = statistics.median(base[f"{kind}_ms"]) if base.get(f"{kind}_ms") else None
            row += (
                f" {statistics.median(t):.1f} | {min(t):.1f}-{max(t):.1f} | {statistics.median(t) / b:.2f} |"
                if b
                else f" {statistics.median(t):.1f} | {min(t):.1f}-{max(t):.1f} | |"
            )
        a, e = v.get("aot_ms"), v.get("eager_ms")
        row += f" {statistics.median(a) / statistics.median(e):.2f} |" if a and e else " |"
        loads = [x for x in v.get("foreign_load_cores", []) if x is not None]
        row += f" {v['last_loss']:.4f} |" if v.get("last_loss") is not None else " |"
        row += f" {max(loads):.2f} |" if loads else " |"
        lines.append(row)
    return "\n".join(lines)


def measure(args, tmp: Path) -> dict:
    variants = {(s, p): {"aot_ms": [], "eager_ms": [], "foreign_load_cores": [], "build": None} for s in MEASURED_STRATEGIES for p in args.measure_precisions}
    for (s, p), v in variants.items():
        art = tmp / f"art.{s.replace('=', '')}.{p}"
        r = run(
            aot(
                "build",
                CODE / "examples/gpt.py",
                "--topology",
                "cpu",
                "--world-size",
                2,
                "--strategy",
                s,
                "--batch-size",
                args.batch_size,
                "--precision",
                p,
                "--no-onnx",
                "--quiet",
                "-o",
                art,
            ),
            tmp / f"build.{s}.{p}.log",
            600,
        )
        v["build"] = {"wall_s": round(r["wall_s"], 1), "foreign_load_cores": r["foreign_load_cores"]}
        if r["rc"] != 0:
            v["error"] = Path(f"{tmp}/build.{s}.{p}.log.err").read_text().strip().splitlines()[-1][:200]
        v["art"] = art
        print(f"built {s} {p}: {v['build']}", file=sys.stderr, flush=True)
    order = list(variants)
    for rnd in range(args.rounds):
        for key in order if rnd % 2 == 0 else order[::-1]:
            v, (s, p) = variants[key], key
            if v.get("error"):
                continue
            metrics = tmp / f"metrics.{s}.{p}.{rnd}.jsonl"
            r = run(
                torchrun("-m", "aot", "run", v["art"], "--steps", args.steps, "--metrics", metrics, "--quiet", "--timeout", 120),
                tmp / f"run.{s}.{p}.{rnd}.log",
                300,
            )
            v["foreign_load_cores"].append(r["foreign_load_cores"])
            if r["rc"] != 0 or not metrics.exists():
                v.setdefault("failed_launches", []).append(Path(f"{tmp}/run.{s}.{p}.{rnd}.log.err").read_text()[-600:])
                continue
            recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            v["aot_ms"].append(statistics.median(x["step_time_s"] for x in recs[WARMUP:]) * 1e3)
            v["last_loss"] = recs[-1]["loss"]
            v["skipped_steps"] = sum(1 for x in recs if x.get("skipped"))
            if "loss_scale" in recs[-1]:
                v["last_loss_scale"] = recs[-1]["loss_scale"]
            msg = f"round {rnd + 1} {s} {p}: aot {v['aot_ms'][-1]:.1f} ms (load {r['foreign_load_cores']})"
            if args.eager:
                result = tmp / f"eager.{s}.{p}.{rnd}.json"
                r = run(
                    torchrun(
                        Path(__file__).resolve(),
                        "--eager-worker",
                        CODE / "examples/gpt.py",
                        "--strategy",
                        s.split("=")[0],
                        "--precision",
                        p,
                        "--steps",
                        args.steps,
                        "--batch-size",
                        args.batch_size,
                        "--result",
                        result,
                    ),
                    tmp / f"eager.{s}.{p}.{rnd}.log",
                    300,
                )
                v["foreign_load_cores"].append(r["foreign_load_cores"])
                if r["rc"] == 0 and result.exists():
                    e = json.loads(result.read_text())
                    v["eager_ms"].append(statistics.median(e["step_time_s"][WARMUP:]) * 1e3)
                    v["eager_last_loss"] = e["loss"][-1]
                    msg += f", eager {v['eager_ms'][-1]:.1f} ms (load {r['foreign_load_cores']})"
                else:
                    v.setdefault("failed_eager", []).append(Path(f"{tmp}/eager.{s}.{p}.{rnd}.log.err").read_text()[-600:])
            print(msg, file=sys.stderr, flush=True)
    for v in variants.values():
        v.pop("art", None)
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--predict", default=DEFAULT_PREDICT, help="MODEL:WORLD cases to plan (empty: none)")
    ap.add_argument("--reduce-bf16", default="8b:1024", help="cases also planned with --reduce-dtype bf16")
    ap.add_argument("--plan-timeout", type=float, default=180.0, help="seconds one `aot plan` may take")
    ap.add_argument(
        "--measure-precisions", default=",".join(MEASURED_PRECISIONS), type=lambda s: tuple(p for p in s.split(",") if p), help="empty: no measurements"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8, help="samples per rank in the measured runs")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--kernels", action=argparse.BooleanOptionalAction, default=True, help="time this CPU's matmul for gpt.py's shapes in fp32, bf16 and fp16 (one thread)"
    )
    ap.add_argument(
        "--max-load", type=float, default=0.3, help="before each plan and launch, wait (up to 60 s) for other processes to use at most this many cores"
    )
    ap.add_argument("--no-snapshot", action="store_true", help="run the working tree, not HEAD's committed files")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    global CODE, QUIET
    QUIET = (args.max_load, QUIET[1])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    result = {
        "commit": commit,
        "snapshot": not args.no_snapshot,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
    }
    with tempfile.TemporaryDirectory(prefix="aot-precision-") as tmpdir:
        tmp = Path(tmpdir)
        if not args.no_snapshot:
            CODE = tmp / "code"
            CODE.mkdir()
            archive = subprocess.run(["git", "archive", "HEAD", "aot", "runner", "examples"], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(CODE)], input=archive, check=True)
        result["torch"] = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True).stdout.strip()
        rows = []
        cases = [c for c in args.predict.split(",") if c]
        reduce_cases = set(c for c in args.reduce_bf16.split(",") if c)
        for case in cases:
            model, world = case.split(":")
            runs = [("fp32", None), ("bf16", None)] + ([("bf16", "bf16")] if case in reduce_cases else [])
            for precision, reduce_dtype in runs:
                row = predict(model, int(world), precision, reduce_dtype, tmp, args.plan_timeout)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("precision_policy", "error")}), file=sys.stderr, flush=True)
                if "left_out" in row:  # the other precision would take as long
                    break
        result["predictions"] = rows
        if rows:
            print("Predictions (aot plan, dgx_a100, --axes fsdp):\n" + prediction_table(rows) + "\n")
        if args.measure_precisions:
            variants = measure(args, tmp)
            result["measured"] = [{"strategy": s, "precision": p, **v} for (s, p), v in variants.items()]
            print(
                f"Measured (examples/gpt.py, 2 CPU ranks, batch {args.batch_size} per rank, {args.rounds} rounds, "
                f"median of steps {WARMUP + 1}..{args.steps}):\n" + measured_table(variants) + "\n"
            )
        if args.kernels:
            wait_for_quiet(*QUIET)
            result["kernels"] = kernels()
            print("This CPU's matmul per dtype (torch.mm, one thread, median of 50):\n" + kernel_table(result["kernels"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
