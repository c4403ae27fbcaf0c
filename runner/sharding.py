"""The flat-padded shard layout of FSDP (ZeRO-3) parameters and optimizer state.

A tensor sharded over N ranks is flattened, zero-padded to a multiple of N elements and cut into
N equal pieces; rank i of the sharding axis holds piece i. Padding elements are zeros in the
weights, receive zero gradients and stay zero under the usual optimizers, so they never change
the numbers. The layout is part of the artifact and checkpoint formats (see artifacts/FORMAT.md).
"""

from __future__ import annotations

import torch


def shard_numel(numel: int, parts: int) -> int:
    return -(-numel // parts)


def shard(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Piece `index` of `t` in the flat-padded layout."""
    size = shard_numel(t.numel(), parts)
    flat = t.detach().reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(size * parts - flat.numel())]) if size * parts != flat.numel() else flat
    return padded[index * size:(index + 1) * size].clone()


def unshard(pieces: list[torch.Tensor], shape: list[int] | torch.Size) -> torch.Tensor:
    """The full tensor of `shape` from its pieces in index order."""
    numel = 1
    for d in shape:
        numel *= d
    return torch.cat([p.reshape(-1) for p in pieces])[:numel].reshape(shape).clone()
