"""Benchmark worker: train from an aot artifact exactly as `aot run` does, with wall-clock marks.

Launched by bench/startup_and_step.py under torchrun, one process per rank:

    BENCH_T0=<launch time.time()> BENCH_RESULT=out.json \
        torchrun --standalone --nproc-per-node 2 bench/aot_worker.py ARTIFACT DATA --steps 30

It does what runner/commands/cli.py's `run` does (Trainer, check_steps, data_source, then trainer.step on
source.batch(step) with only the step timed) minus click and printing, and records time.time()
as its first statement so its start-up is measured the same way as bench/ddp_worker.py's.
"""

import time

T_TOP = time.time()  # first statement: as close to this process's start as Python code gets

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402, F401  (imported here to time torch's import alone)

T_TORCH = time.time()

import torch.distributed as dist  # noqa: E402

from runner.execution.trainer import Trainer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("artifact")
parser.add_argument("data")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--tier", default="auto", choices=["auto", "compiled", "portable"], help="as `aot run --tier`")
args = parser.parse_args()

trainer = Trainer(args.artifact, None, tier=args.tier)
T_LOADED = time.time()
trainer.check_steps(args.steps)
source = trainer.data_source(args.data)
T_READY = time.time()

step_times, cpu_times, losses, T_STEP1 = [], [], [], None
for _ in range(args.steps):
    inputs, targets = source.batch(trainer.step_index)
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = trainer.step(inputs, targets)
    step_times.append(time.perf_counter() - start)
    cpu_times.append(time.process_time() - cpu_start)  # all of this rank's threads
    losses.append(loss)
    if T_STEP1 is None:
        T_STEP1 = time.time()

if trainer.rank == 0 and os.environ.get("BENCH_RESULT"):
    t0 = float(os.environ.get("BENCH_T0", T_TOP))
    result = {
        "variant": "aot",
        "tier": trainer.tier,
        "world_size": trainer.world_size,
        "launch_to_process_s": T_TOP - t0,  # torchrun + interpreter start
        "import_torch_s": T_TORCH - T_TOP,
        "setup_s": T_READY - T_TORCH,  # runner import, verify + load artifact, process group, data
        "load_artifact_s": T_LOADED - T_TORCH,
        "first_step_s": step_times[0] if step_times else None,
        "launch_to_step1_end_s": (T_STEP1 - t0) if T_STEP1 else None,
        "process_to_step1_end_s": (T_STEP1 - T_TOP) if T_STEP1 else None,
        "step_times_s": step_times,
        "step_cpu_s": cpu_times,
        "losses": losses,
    }
    with open(os.environ["BENCH_RESULT"], "w") as f:
        json.dump(result, f)
if dist.is_initialized():
    dist.barrier()  # measurements are done; let both ranks reach teardown together
    dist.destroy_process_group()
