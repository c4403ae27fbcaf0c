"""The run-time replica check: every tensor that several ranks hold a copy of is still the same copy.

The build proves from the graph that each parameter is sharded, reduced or identical on every mesh
axis (the manifest's `replicas`, aot/capture/replicas.py); this checks the result on the live
ranks, where a nondeterministic kernel, a flipped bit or a defect the proof missed would show.
Each rank hashes its copies bit for bit (a position-weighted sum of their raw bits, so a swap of
two elements counts), all-gathers the hashes over each axis that replicates them, and compares.

What replicates what, from the manifest alone (the runner never imports aot): data-parallel
ranks (dp) hold copies of everything; fsdp ranks hold shards of parameters and optimizer state
and copies of buffers; tp ranks hold copies of every parameter tp does not split and of every
buffer. Buffers that the build left per rank (plain BatchNorm's statistics under data
parallelism, as eager DDP) and pipeline stages (different tensors) are not compared.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runner.errors import AotError
from runner.format.axes import DATA_AXES, EP, FSDP, PP, TP

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """An int64 that changes with any bit of `t` (almost surely) and with any reordering of it."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(flat.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
    return (bits * weights).sum() * 1_000_003 + flat.numel()


def replicated_over(manifest: dict, name: str, kind: str) -> list[str]:
    """The mesh axes (of degree > 1) over which ranks hold copies of tensor `name` (`kind`:
    "param", "optim", "buffer", or "whole": state every rank holds whole, such as step counters
    and the loss scale), per the module docstring."""
    axes = [a for a, d in zip(manifest["mesh"]["axes"], manifest["mesh"]["shape"]) if d > 1]
    tp_split = set(((manifest.get("tensor_parallel") or {}).get("params") or {}))
    experts = set((manifest.get("expert_parallel") or {}).get("params") or [])
    replicas = manifest.get("replicas") or {}
    per_rank = set(replicas.get("buffers_per_rank", [])) if replicas else None
    over = []
    for axis in axes:
        if axis == PP:
            continue
        if kind == "whole":
            over.append(axis)
        elif kind == "buffer":
            data_axis = axis in DATA_AXES
            # an artifact without the proof does not say which buffers are per rank: skip them there
            if data_axis and (per_rank is None or name in per_rank):
                continue
            over.append(axis)
        elif axis == FSDP and manifest.get("sharding"):
            continue
        elif axis == TP and name in tp_split:
            continue
        elif axis == EP and name in experts:
            continue
        else:
            over.append(axis)
    return over


def check_replicas(trainer, when: str) -> None:
    """Compare every replicated tensor of `trainer` across the ranks that hold copies; refuses
    (AotError, one line naming the tensor, the axis and the ranks) at the first that differs.
    `when`: words for the message ("at step 12")."""
    if not dist.is_initialized():
        return
    manifest = trainer.artifact.manifest
    held = [(name, "buffer" if name in trainer.state_spec["buffers"] else "param", t) for name, t in trainer._weights.items()]
    held += [(key, "optim" if t.dim() else "whole", t) for key, t in trainer._optimizer.items()]
    by_axis: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, kind, tensor in held:
        owner = name.split(":")[0] if kind == "optim" else name
        for axis in replicated_over(manifest, owner, kind):
            by_axis.setdefault(axis, []).append((name, tensor))
    for axis, tensors in sorted(by_axis.items()):
        group_name = f"aot.{axis}"
        if group_name not in trainer.groups:
            continue
        ranks, group = trainer.groups[group_name]
        # on the run's device: an NCCL group carries only its device's tensors (0-dim optimizer
        # state stays on the host, runner/execution/trainer.py, so each hash is moved there first)
        mine = torch.stack([fingerprint(t).to(trainer.device) for _, t in tensors])
        gathered = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered).cpu()
        for i, (name, _) in enumerate(tensors):
            values = [int(v) for v in table[:, i]]
            if len(set(values)) > 1:
                odd = next(r for r, v in zip(ranks, values) if v != values[0])
                raise AotError(
                    f"replica check {when}: {name} differs between ranks {ranks[0]} and {odd}, which hold copies of it over {axis}; "
                    f"stopping (training would go on diverging; the last checkpoint is left as it was)"
                )
