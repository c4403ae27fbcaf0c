"""Eager PyTorch reference for the tests: DistributedDataParallel on the same model file and data.

Run under torchrun: `torchrun --nproc-per-node N tests/helpers/ddp_reference.py MODEL DATA OUT
--steps K --batch-size B [--seed S]`. Written independently of aot: it imports nothing from
aot or runner, so the tests compare the artifact against plain torch.
Rank 0 writes OUT/losses.json (global-batch loss per step) and OUT/state_dict.safetensors.

Mixed precision, as its eager users write it: `--precision bf16|fp16` runs forward and loss under
torch.autocast("cpu"); `--param-dtype` casts each parameter before use (FSDP2's
MixedPrecisionPolicy.param_dtype: what its all-gather hands the forward); `--reduce-dtype bf16`
all-reduces gradients in bf16 (what DDP's bf16_compress_hook does, which itself needs NCCL); fp16 scales the loss with
torch.amp.GradScaler (the model file's `grad_scaler` arguments), steps the scheduler only after
an update that ran, and writes OUT/scaler.json (the scale after each step, skipped steps).
"""

import argparse
import contextlib
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
parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
parser.add_argument("--param-dtype", choices=["bf16", "fp16"])
parser.add_argument("--reduce-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
# the rows of each rank's batch in another order (seeded): for a model whose step does not depend on
# the order (BatchNorm's statistics, a mean loss), the same training summed in another order
parser.add_argument("--permute-rows", type=int, metavar="SEED")
args = parser.parse_args()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

spec = importlib.util.spec_from_file_location("reference_model", args.model_file)
user = importlib.util.module_from_spec(spec)
spec.loader.exec_module(user)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed)
model = user.model()
if args.init_from:
    model.load_state_dict(load_file(args.init_from))
if args.param_dtype:
    # FSDP2 with MixedPrecisionPolicy(param_dtype, reduce_dtype): the forward sees every parameter
    # cast (what its all-gather hands it), and gradients, cast to reduce_dtype, are summed over the
    # ranks and averaged (its reduce-scatter, here as an all_reduce of whole gradients).
    # The cast parameters stay in the model through backward: a torch.utils.checkpoint call recomputes
    # its forward there, with the parameters it finds (torch.func.functional_call would have restored
    # the fp32 ones by then).
    from torch.nn.utils.stateless import _reparametrize_module

    named = dict(model.named_parameters())
    ddp = model
    # tie_weights: a tied weight's other names (T5's embeddings, nanoGPT's lm_head) get the same cast copy
    cast_parameters = lambda: _reparametrize_module(model, {n: p.to(DTYPES[args.param_dtype]) for n, p in named.items()}, tie_weights=True)
elif args.reduce_dtype != "fp32":
    ddp = model  # DDP's bf16/fp16 compression hooks need NCCL: their arithmetic, below, on gloo
else:
    ddp = DDP(model) if world > 1 else model
MANUAL_REDUCE = bool(args.param_dtype) or args.reduce_dtype != "fp32"
if not args.param_dtype:
    cast_parameters = contextlib.nullcontext


def average_gradients():
    """Gradients averaged over the ranks in --reduce-dtype, where DDP does not do it."""
    if not MANUAL_REDUCE or world == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            sent = p.grad.to(DTYPES[args.reduce_dtype])
            dist.all_reduce(sent)
            p.grad.copy_(sent.to(p.grad.dtype) / world)


scaler = torch.amp.GradScaler("cpu", **getattr(user, "grad_scaler", {})) if args.precision == "fp16" else None
autocast = (lambda: torch.autocast("cpu", dtype=DTYPES[args.precision])) if args.precision != "fp32" else (lambda: contextlib.nullcontext())
scales, skipped = [], []
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
    if args.permute_rows is not None:
        idx = idx[torch.randperm(B, generator=torch.Generator().manual_seed(args.permute_rows * 1_000_003 + step))]
    x = [t[idx] for t in inputs]
    y = targets[idx]
    opt.zero_grad()
    # The runner's per-step seed (artifacts/FORMAT.md, "Randomness"): dropout masks line up.
    torch.manual_seed(((args.seed * 1_000_003 + step) * 1_009 + rank) % 2**63)
    with cast_parameters():
        with autocast():
            loss = loss_fn(ddp(*x), y)
        (scaler.scale(loss) if scaler else loss).backward()
    average_gradients()
    if scaler:
        scaler.unscale_(opt)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip)
    ran = True
    if scaler:
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        # an update that overflowed lowers the scale: the optimizer did not step
        ran = scaler.get_scale() >= before
        scales.append(scaler.get_scale())
        skipped.append(not ran)
    else:
        opt.step()
    if sched is not None and ran:
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
    if scaler:
        (out / "scaler.json").write_text(json.dumps({"scales": scales, "skipped": skipped}))
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / "state_dict.safetensors"))
# Tear down together: a gloo rank destroying its group while a peer is still busy can abort.
dist.barrier()
dist.destroy_process_group()
