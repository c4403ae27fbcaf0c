"""Benchmark worker: eager (or torch.compile'd) DistributedDataParallel on a model file.

Launched by bench/startup_and_step.py under torchrun, one process per rank:

    BENCH_T0=<launch time.time()> BENCH_RESULT=out.json \
        torchrun --standalone --nproc-per-node 2 bench/ddp_worker.py examples/gpt.py DATA \
        --steps 30 --batch-size 8 [--compile]

It imports nothing from aot or runner. It follows the model-file contract the way `aot build`
does (seed, model(), optimizer(), scheduler(), loss(), max_grad_norm) and slices the data the way
`aot run` does: step s, rank r takes rows [s*G + r*B, s*G + (r+1)*B) mod rows, G = B * world.
Rank 0 writes BENCH_RESULT: wall-clock milestones relative to BENCH_T0, per-step times and losses.
"""

import time

T_TOP = time.time()  # first statement: as close to this process's start as Python code gets

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

T_TORCH = time.time()

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("model_file")
parser.add_argument("data")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--compile", action="store_true", help="train torch.compile(DDP(model))")
args = parser.parse_args()

spec = importlib.util.spec_from_file_location("bench_user_model", args.model_file)
user = importlib.util.module_from_spec(spec)
spec.loader.exec_module(user)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed)
model = user.model()
ddp = DDP(model)
step_fn = torch.compile(ddp) if args.compile else ddp
params = list(model.parameters())
opt = user.optimizer(params) if hasattr(user, "optimizer") else torch.optim.AdamW(params, lr=1e-3)
sched = user.scheduler(opt) if hasattr(user, "scheduler") else None
loss_fn = getattr(user, "loss", None) or (lambda o, t: F.cross_entropy(o.reshape(-1, o.size(-1)), t.reshape(-1)))
clip = getattr(user, "max_grad_norm", None)

data = load_file(args.data)
inputs = [data["inputs"]] if "inputs" in data else [data[f"inputs.{i}"] for i in range(len(data) - 1)]
targets = data["targets"]
rows, B = targets.shape[0], args.batch_size
T_READY = time.time()


def batch(step):
    idx = (torch.arange(B) + step * B * world + rank * B) % rows
    return [t.index_select(0, idx) for t in inputs], targets.index_select(0, idx)


step_times, cpu_times, losses, T_STEP1 = [], [], [], None
for step in range(args.steps):
    x, y = batch(step)  # outside the timed region, as in `aot run`
    start, cpu_start = time.perf_counter(), time.process_time()
    opt.zero_grad()
    loss = loss_fn(step_fn(*x), y)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    if sched is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched.step()
    # The global-batch loss as a Python float, as aot's Trainer.step returns it.
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    value = global_loss.item() / world
    step_times.append(time.perf_counter() - start)
    cpu_times.append(time.process_time() - cpu_start)  # all of this rank's threads
    losses.append(value)
    if T_STEP1 is None:
        T_STEP1 = time.time()

if rank == 0 and os.environ.get("BENCH_RESULT"):
    t0 = float(os.environ.get("BENCH_T0", T_TOP))
    try:
        buckets = len(str(ddp._get_ddp_logging_data().get("bucket_sizes", "")).split(",")) or None
    except Exception:  # a private API: the count is context only
        buckets = None
    result = {
        "variant": "ddp_compile" if args.compile else "ddp_eager",
        "world_size": world,
        "launch_to_process_s": T_TOP - t0,  # torchrun + interpreter start
        "import_torch_s": T_TORCH - T_TOP,
        "setup_s": T_READY - T_TORCH,  # model file, process group, DDP, optimizer, data
        "first_step_s": step_times[0] if step_times else None,
        "launch_to_step1_end_s": (T_STEP1 - t0) if T_STEP1 else None,
        "process_to_step1_end_s": (T_STEP1 - T_TOP) if T_STEP1 else None,
        "step_times_s": step_times,
        "step_cpu_s": cpu_times,
        "losses": losses,
        "parameter_tensors": len(params),
        "ddp_buckets": buckets,
    }
    with open(os.environ["BENCH_RESULT"], "w") as f:
        json.dump(result, f)
dist.barrier()  # measurements are done; let both ranks reach teardown together
dist.destroy_process_group()
