"""Eager PyTorch reference for the tests: DistributedDataParallel on the same model file and data.

Run under torchrun: `torchrun --nproc-per-node N tests/helpers/ddp_reference.py MODEL DATA OUT
--steps K --batch-size B [--seed S]`. Written independently of aot: it imports nothing from
aot or runner, so the tests compare the artifact against plain torch.
Rank 0 writes OUT/losses.json (global-batch loss per step) and OUT/state_dict.safetensors.
"""

import argparse
import importlib.util
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("model_file")
parser.add_argument("data")
parser.add_argument("out")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--batch-size", type=int, required=True)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--init-from", help="a safetensors file of model.state_dict() to start from")
args = parser.parse_args()

spec = importlib.util.spec_from_file_location("reference_model", args.model_file)
user = importlib.util.module_from_spec(spec)
spec.loader.exec_module(user)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed)
model = user.model()
if args.init_from:
    model.load_state_dict(load_file(args.init_from))
ddp = DDP(model) if world > 1 else model
params = list(model.parameters())
opt = user.optimizer(params) if hasattr(user, "optimizer") else torch.optim.AdamW(params, lr=1e-3)
sched = user.scheduler(opt) if hasattr(user, "scheduler") else None
loss_fn = getattr(user, "loss", None) or (lambda o, t: F.cross_entropy(o.reshape(-1, o.size(-1)), t.reshape(-1)))
clip = getattr(user, "max_grad_norm", None)

data = load_file(args.data)
inputs = [data["inputs"]] if "inputs" in data else [data[f"inputs.{i}"] for i in range(len(data) - 1)]
targets = data["targets"]
rows, B = targets.shape[0], args.batch_size
losses = []
for step in range(args.steps):
    idx = (torch.arange(B) + step * B * world + rank * B) % rows
    x = [t[idx] for t in inputs]
    y = targets[idx]
    opt.zero_grad()
    # The runner's per-step seed (artifacts/FORMAT.md, "Randomness"): dropout masks line up.
    torch.manual_seed(((args.seed * 1_000_003 + step) * 1_009 + rank) % 2**63)
    loss = loss_fn(ddp(*x), y)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    if sched is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    losses.append(global_loss.item() / world)

if rank == 0:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps(losses))
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / "state_dict.safetensors"))
# Tear down together: a gloo rank destroying its group while a peer is still busy can abort.
dist.barrier()
dist.destroy_process_group()
