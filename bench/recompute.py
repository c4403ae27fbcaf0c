"""Benchmark: activation recomputation, predicted and measured peak memory and step time per budget.

    python bench/recompute.py [--strategies dp=2,fsdp=2,tp=2] [--rounds 5] [--steps 30]
        [--llama 1b,8b] [--out recompute.json]

Part 1, measured on CPU ranks. examples/gpt.py is built for `--topology cpu --world-size 2` under
each strategy (batch 8 per data-parallel rank, `--no-onnx`) at activation budgets 1.0 (nothing
recomputed), 0.5 and the smallest feasible (which the build states when asked for 0), and each
artifact is trained with `torchrun --standalone --nproc-per-node 2 -m aot run ART --steps N
--metrics M --profile P --quiet`. Measured: every rank's peak memory of the first step (`--profile`:
live tensor bytes, runner/execution/memory_tracking.py) against the build's prediction (manifest
`memory.predicted.peak`), and the step time: the median `step_time_s` of rank 0's steps after the
first 5. The budgets of a strategy are interleaved over --rounds rounds (each once per round, the
order reversed every other round) so that load on this shared machine hits them alike; a budget's
time is the median over rounds, and its ratio to budget 1.0 is taken within each round, then the
median. Activation memory: the prediction's `activations_peak` (forward-made storages alive at
once, at most) and `kept_activation_bytes` (what backward reads of forward, as built); the measured
transient (the measured peak less the step's inputs, which are resident) bounds it from above.

Part 2, predicted for GPUs. Llama presets of examples/llama.py (AOT_SIZE, sequence 2048, batch 1)
built with `--topology dgx_a100 --world-size 8 --strategy fsdp=8` at the same budgets: the
predicted peak per rank, itemized, the predicted seconds of recomputation per step and the
predicted step time (the manifest's `time`, priced on the program as built).

Children run with OMP_NUM_THREADS=1 from this working tree. --out writes every number as JSON;
stdout gets the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5
GiB, MiB = 2**30, 2**20


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    return env


def _aot(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aot", *map(str, args)], cwd=REPO, env=env or _env(), capture_output=True, text=True)


def smallest_budget(model: str, build_args: list, folder: Path, env=None) -> str:
    r = _aot("build", model, *build_args, "-o", folder / "refused", "--quiet", "--no-onnx", "--activation-budget", 0, env=env)
    found = re.search(r"smallest feasible is ([0-9.]+)", r.stderr)
    if found is None:
        raise SystemExit(f"expected a refusal stating the smallest budget, got: {r.stderr or r.stdout}")
    return found.group(1)


def build(model: str, build_args: list, budget: str, out: Path, env=None) -> dict:
    started = time.perf_counter()
    r = _aot("build", model, *build_args, "-o", out, "--quiet", "--no-onnx", "--activation-budget", budget, env=env)
    if r.returncode:
        raise SystemExit(f"build failed: {r.stderr}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {"memory": manifest["memory"], "time": manifest["time"], "build_s": time.perf_counter() - started}


def train(art: Path, steps: int, folder: Path) -> dict:
    metrics, profile = folder / "metrics.jsonl", folder / "profile"
    for path in (metrics,):
        path.unlink(missing_ok=True)
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
        raise SystemExit(f"aot run failed: {r.stderr[-2000:]}")
    times = [json.loads(line)["step_time_s"] for line in metrics.read_text().splitlines()][WARMUP:]
    summary = json.loads((profile / "profile.json").read_text())
    return {"step_s": statistics.median(times), "measured_peak_bytes": summary["memory"]["measured_peak_bytes"], "memory_method": summary["memory"]["method"]}


def measured(strategies: list[str], rounds: int, steps: int, folder: Path) -> list[dict]:
    results = []
    for strategy in strategies:
        args = ["--topology", "cpu", "--world-size", 2, "--strategy", strategy, "--batch-size", 8]
        least = smallest_budget("examples/gpt.py", args, folder)
        budgets = ["1.0", "0.5", least] if float(least) < 0.5 else ["1.0", least]
        builds = {b: build("examples/gpt.py", args, b, folder / f"{strategy}-{b}") for b in budgets}
        runs: dict[str, list[dict]] = {b: [] for b in budgets}
        for k in range(rounds):
            for b in budgets if k % 2 == 0 else budgets[::-1]:
                runs[b].append(train(folder / f"{strategy}-{b}", steps, folder))
                print(
                    f"  {strategy} budget {b} round {k + 1}: {runs[b][-1]['step_s'] * 1e3:.2f} ms, peaks {runs[b][-1]['measured_peak_bytes']}", file=sys.stderr
                )
        for b in budgets:
            predicted = builds[b]["memory"]["predicted"]
            peaks = runs[b][0]["measured_peak_bytes"]
            results.append(
                {
                    "strategy": strategy,
                    "budget": float(b),
                    "predicted": predicted,
                    "recompute": builds[b]["memory"]["recompute"],
                    "predicted_step_s": builds[b]["time"]["predicted"]["step_s"],
                    "measured_peak_bytes": peaks,
                    "memory_method": runs[b][0]["memory_method"],
                    "peak_ratio": max(peaks) / predicted["peak"],
                    "step_s": statistics.median(r["step_s"] for r in runs[b]),
                    "step_ratio": statistics.median(r["step_s"] / base["step_s"] for r, base in zip(runs[b], runs["1.0"])),
                }
            )
    return results


def predicted(sizes: list[str], folder: Path) -> list[dict]:
    results = []
    args = ["--topology", "dgx_a100", "--world-size", 8, "--strategy", "fsdp=8", "--batch-size", 1]
    for size in sizes:
        env = _env(AOT_SIZE=size)
        least = smallest_budget("examples/llama.py", args, folder, env=env)
        for b in ["1.0", "0.5", least]:
            built = build("examples/llama.py", args, b, folder / f"llama-{size}-{b}", env=env)
            results.append({"model": f"llama {size}", "budget": float(b), **built})
            print(f"  llama {size} budget {b}: peak {built['memory']['predicted']['peak'] / GiB:.2f} GiB", file=sys.stderr)
    return results


def _g(n: int) -> str:
    return f"{n / GiB:.2f}"


def _m(n: int) -> str:
    return f"{n / MiB:.2f}"


def report(cpu: list[dict], gpu: list[dict]) -> str:
    lines = [
        "### Measured: examples/gpt.py, 2 CPU ranks, batch 8 per data rank",
        "",
        "| strategy | activation budget | predicted peak, MiB | measured peak (rank 0, 1), MiB | measured / predicted | "
        "activations kept, MiB | activations peak, MiB | step, ms | step vs 1.0 | predicted step, ms | predicted vs 1.0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["strategy"]: r["predicted_step_s"] for r in cpu if r["budget"] == 1.0}
    for r in cpu:
        p, rc = r["predicted"], r["recompute"]
        kept = rc.get("kept_activation_bytes", rc.get("saved_activation_bytes"))
        lines.append(
            f"| {r['strategy']} | {r['budget']:.3g} | {_m(p['peak'])} | "
            f"{', '.join(_m(x) for x in r['measured_peak_bytes'])} | {r['peak_ratio']:.3f} | "
            f"{_m(kept) if kept is not None else '-'} | {_m(p['activations_peak'])} | {r['step_s'] * 1e3:.2f} | "
            f"{r['step_ratio']:.3f} | {r['predicted_step_s'] * 1e3:.2f} | {r['predicted_step_s'] / base[r['strategy']]:.3f} |"
        )
    if gpu:
        lines += [
            "",
            "### Predicted: Llama presets, dgx_a100, fsdp=8, sequence 2048, batch 1",
            "",
            "| model | activation budget | peak, GiB | activations at peak, GiB | gradients at peak, GiB | "
            "activations peak, GiB | recomputed values | predicted recompute, ms/step | predicted step, ms | "
            "step vs 1.0 | build, s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = {r["model"]: r["time"]["predicted"]["step_s"] for r in gpu if r["budget"] == 1.0}
        for r in gpu:
            step = r["time"]["predicted"]["step_s"]
            p, rc = r["memory"]["predicted"], r["memory"]["recompute"]
            lines.append(
                f"| {r['model']} | {r['budget']:.3g} | {_g(p['peak'])} | {_g(p['at_peak']['activations'])} | "
                f"{_g(p['at_peak']['gradients'])} | {_g(p['activations_peak'])} | {rc.get('recomputed_values', 0)} | "
                f"{rc.get('predicted_recompute_s', 0) * 1e3:.1f} | {step * 1e3:.1f} | {step / base[r['model']]:.3f} | "
                f"{r['build_s']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="dp=2,fsdp=2,tp=2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--llama", default="1b,8b", help="presets to predict ('' for none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="aot-bench-recompute-") as tmp:
        folder = Path(tmp)
        cpu = measured([s for s in args.strategies.split(",") if s], args.rounds, args.steps, folder)
        gpu = predicted([s for s in args.llama.split(",") if s], folder)
    print(report(cpu, gpu))
    print(f"\ncommit {commit}, {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"commit": commit, "cpu": cpu, "gpu": gpu}, indent=1) + "\n")


if __name__ == "__main__":
    main()
