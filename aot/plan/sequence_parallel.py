"""Where sequence parallelism splits the residual stream, derived from the tensor-parallel plan
(aot.plan.tensor_parallel), and the sequence length it needs."""

from __future__ import annotations

import torch
from torch import nn

from aot.errors import AotError

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm) if hasattr(nn, "RMSNorm") else (nn.LayerNorm, nn.GroupNorm)


def sequence_parallel_layout(model: nn.Module, plan: dict[str, str], where: str) -> dict[str, list[str]]:
    """Where sequence parallelism splits the residual stream, from the tensor-parallel plan.

    Each column/row-wise group sits in one module (its lowest common ancestor: an attention or MLP
    module) whose input is gathered whole along the sequence and whose output is reduce-scattered
    back; those modules sit in blocks, children of one container, that run one after another on the
    residual stream. Between the first block's input and the last block's output that stream is
    split along dimension 1 (the sequence), so the blocks' norms and dropouts run on 1/tp of the
    tokens. Returns {"regions", "norms", "blocks"} (module names, blocks in order)."""
    regions = set()
    for name in plan:
        parent = name.rpartition(".")[0]
        regions.add(parent)
    # Merge regions that are ancestors of one another (a plan naming modules at several depths).
    regions = {r for r in regions if not any(r != o and r.startswith(o + ".") for o in regions)}
    if "" in regions:
        raise AotError(
            f"--sequence-parallel: {where} splits layers at the top of the model; sequence parallelism needs them inside blocks (attention, MLP modules)"
        )
    blocks = sorted({r.rpartition(".")[0] for r in regions})
    containers = {b.rpartition(".")[0] for b in blocks}
    modules = dict(model.named_modules())
    if len(containers) != 1 or "" in blocks:
        raise AotError(f"--sequence-parallel: the split layers are not inside one stack of blocks (found {', '.join(blocks) or 'none'})")
    container = containers.pop()
    order = [f"{container}.{child}" if container else child for child, _ in modules[container].named_children()]
    positions = sorted(order.index(b) for b in blocks)
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise AotError(f"--sequence-parallel: blocks {', '.join(blocks)} are not consecutive in {container!r}")
    blocks = [order[i] for i in positions]
    # On the split stream (in a block, outside the regions) every module holding weights sees 1/tp of
    # the tokens, so its weights' gradients must be summed over tp: torch's SequenceParallel style
    # does that for per-feature weights (norms: torch's LayerNorm and RMSNorm, transformers' own
    # LlamaRMSNorm and the like, found by their 1-d weights). Other weights there are refused.
    norms = []
    for b in blocks:
        for n, m in modules[b].named_modules(prefix=b):
            own = list(m.parameters(recurse=False))
            if not own or any(n.startswith(r + ".") or n == r for r in regions):
                continue
            if isinstance(m, _NORMS) or (not list(m.children()) and all(p.dim() == 1 for p in own)):
                norms.append(n)
            else:
                raise AotError(
                    f"--sequence-parallel: {n} ({type(m).__name__}) holds weights on the sequence-split stream outside the "
                    f"tensor-parallel layers, which sequence parallelism cannot split; only per-feature weights (norms) may sit there"
                )
    return {"regions": sorted(regions), "norms": sorted(norms), "blocks": blocks}


def check_sequence_length(model: nn.Module, inputs: list[torch.Tensor], first_block: str, tp: int) -> None:
    """The residual stream's dimension 1 must divide by tp: every rank must trace the same shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    module = dict(model.named_modules())[first_block]
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            model(*inputs)
    finally:
        handle.remove()
    if not seen or len(seen[0]) < 2:
        raise AotError(f"--sequence-parallel: {first_block} does not take a (batch, sequence, ...) tensor")
    if seen[0][1] % tp:
        raise AotError(f"--sequence-parallel with tp={tp}: the sequence length {seen[0][1]} does not divide by {tp}")
