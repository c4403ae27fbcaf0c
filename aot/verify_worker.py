"""One rank of `aot verify` (run under torchrun): the artifact and eager DDP side by side."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from aot.capture.model_file import load_model_file
from runner.execution.groups import leave_process_group
from runner.execution.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifact")
    parser.add_argument("model_file")
    parser.add_argument("result")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--data")
    args = parser.parse_args()

    trainer = Trainer(args.artifact, device="cpu", allow_topology_mismatch=True)
    source = trainer.data_source(args.data)
    mf = load_model_file(args.model_file)
    torch.manual_seed(trainer.artifact.manifest["build"]["seed"])
    model = mf.model()
    model.train()
    ddp = DistributedDataParallel(model) if dist.is_initialized() and trainer.world_size > 1 else model
    params = list(model.parameters())
    optimizer = mf.optimizer(params)
    scheduler = mf.scheduler(optimizer) if mf.scheduler else None

    losses = []
    for _ in range(args.steps):
        inputs, targets = source.batch(trainer.step_index)
        built = trainer.step(inputs, targets)
        optimizer.zero_grad()
        loss = mf.loss(ddp(*inputs), targets)
        loss.backward()
        if mf.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, mf.max_grad_norm)
        optimizer.step()
        if scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's warning about scheduler/optimizer order
                scheduler.step()
        eager = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(eager)
            eager /= trainer.world_size
        losses.append([built, eager.item()])

    # the ranks' copies first: a rank that drifted would be hidden by the gathered state below
    trainer.check_replicas(f"after step {trainer.step_index} of aot verify")
    reference = model.state_dict()
    # every rank gathers the same whole state, and eager DDP keeps its replicas equal: rank 0's view is the run's
    weight_diffs = {k: (t.double() - reference[k].double()).abs().max().item() for k, t in trainer.state_dict().items()}
    worst_weight = max(weight_diffs, key=lambda k: weight_diffs[k])
    weight_diff = weight_diffs[worst_weight]
    if trainer.rank == 0:
        Path(args.result).write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "world_size": trainer.world_size,
                    "losses": losses,
                    "max_loss_diff": max(abs(a - b) for a, b in losses),
                    "max_weight_diff": weight_diff,
                    "worst_weight": worst_weight,
                    "weight_diffs": weight_diffs,
                }
            )
        )
    leave_process_group()


if __name__ == "__main__":
    main()
