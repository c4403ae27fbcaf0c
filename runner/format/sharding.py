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
    return padded[index * size : (index + 1) * size].clone()


def unshard(pieces: list[torch.Tensor], shape: list[int] | torch.Size) -> torch.Tensor:
    """The full tensor of `shape` from its pieces in index order."""
    numel = 1
    for d in shape:
        numel *= d
    return torch.cat([p.reshape(-1) for p in pieces])[:numel].reshape(shape).clone()


# -- state shards over the pp, tp, ep and fsdp axes --------------------------------------------
# A rank's training state is one of pp x tp x ep x fsdp shards: its pipeline stage's parameters (pp
# index), the tensor-parallel slice (tp index) of every split parameter, the expert-parallel slice
# (ep index) of every experts weight, flat-padded over fsdp (fsdp index). Shards are numbered
# pp-major, then tp, then ep:
# shard = ((pp_index * tp_size + tp_index) * ep_size + ep_index) * fsdp_size + fsdp_index, in
# artifacts and checkpoints alike (without ep, ep_size is 1: the numbering before ep).


def shard_count(sharding: dict | None, tensor_parallel: dict | None, pipeline: dict | None = None, expert_parallel: dict | None = None) -> int:
    sizes = (sharding, tensor_parallel, pipeline, expert_parallel)
    count = 1
    for entry in sizes:
        count *= (entry or {}).get("size", 1)
    return count


def axis_index(coords: dict[str, int], entry: dict | None) -> int:
    """A rank's coordinate on the axis a manifest entry (sharding, tensor_parallel, pipeline) names;
    0 without the entry (a validated manifest's entries always name their axis)."""
    return coords.get(entry["axis"], 0) if entry else 0


def shard_number(
    coords: dict[str, int], sharding: dict | None, tensor_parallel: dict | None, pipeline: dict | None = None, expert_parallel: dict | None = None
) -> int:
    tp_index, ep_index = axis_index(coords, tensor_parallel), axis_index(coords, expert_parallel)
    fsdp_index, fsdp_size = axis_index(coords, sharding), (sharding or {}).get("size", 1)
    pp_index = axis_index(coords, pipeline)
    inner = (tp_index * (expert_parallel or {}).get("size", 1) + ep_index) * fsdp_size + fsdp_index
    return pp_index * shard_count(sharding, tensor_parallel, None, expert_parallel) + inner


def tp_slice_shape(shape: list[int], dim: int | None, parts: int) -> list[int]:
    """The shape of one tensor-parallel slice of a tensor of `shape` split along `dim`."""
    shape = list(shape)
    if dim is not None:
        shape[dim] //= parts
    return shape


def tp_style(style: str) -> tuple[str, int]:
    """A tensor-parallel plan entry's kind ("colwise" or "rowwise") and the number of equal parts
    its output features form: "colwise:3" is a fused q/k/v projection (see `tp_slice`), 1 otherwise."""
    kind, _, parts = style.partition(":")
    return kind, int(parts) if parts else 1


def tp_fused(tensor_parallel: dict | None, name: str) -> int:
    """K where a manifest's `tensor_parallel.fused` says parameter `name`'s split dimension holds K
    equal parts (1 otherwise)."""
    return ((tensor_parallel or {}).get("fused") or {}).get(name, 1)


def tp_slice(t: torch.Tensor, dim: int | None, parts: int, index: int, fused: int = 1) -> torch.Tensor:
    """Slice `index` of `t` split evenly along `dim` (the whole tensor when `dim` is None): what
    tensor-parallel rank `index` holds. Where `dim` holds `fused` equal parts (GPT-2's c_attn:
    q, k and v side by side), the rank holds slice `index` of each part, concatenated, so that its
    output's parts are its heads of q, of k and of v. `join_tp_slices` is its inverse."""
    if dim is None or parts == 1:
        return t.detach().clone()
    if fused > 1:
        return torch.cat([part.chunk(parts, dim)[index] for part in t.detach().chunk(fused, dim)], dim)
    return t.detach().chunk(parts, dim)[index].clone()


def join_tp_slices(slices: list[torch.Tensor], dim: int, fused: int = 1) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's slice, in rank order (`tp_slice` inverted)."""
    if fused == 1:
        return torch.cat(slices, dim)
    parts = [s.chunk(fused, dim) for s in slices]
    return torch.cat([parts[t][k] for k in range(fused) for t in range(len(slices))], dim)


def expert_slice(t: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Slice `index` of an experts weight split evenly along dimension 0 (its experts): what
    expert-parallel rank `index` holds. `torch.cat(slices)` in ep rank order is its inverse."""
    return t.detach().chunk(parts, 0)[index].clone() if parts > 1 else t.detach().clone()


def assemble(
    pieces: list[dict[str, torch.Tensor]],
    shapes: dict[str, list[int]],
    sharding: dict | None,
    tensor_parallel: dict | None,
    pipeline: dict | None = None,
    expert_parallel: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Full tensors from every shard's tensors (in shard order): fsdp pieces unflattened into
    their slice, expert-parallel slices concatenated along the experts, tensor-parallel slices
    along their split dimension. Tensors that no axis splits are taken from shard 0 of their
    stage; a pipeline's stages hold disjoint tensors but tied ones, which each holder keeps equal
    (the first stage's is taken)."""
    if pipeline:
        per_stage = shard_count(sharding, tensor_parallel, None, expert_parallel)
        full = {}
        for k in reversed(range(pipeline["size"])):
            full.update(assemble(pieces[k * per_stage : (k + 1) * per_stage], shapes, sharding, tensor_parallel, None, expert_parallel))
        return full
    full = dict(pieces[0])
    fsdp = (sharding or {}).get("size", 1)
    tp, ep = (tensor_parallel or {}).get("size", 1), (expert_parallel or {}).get("size", 1)
    dims = (tensor_parallel or {}).get("params", {})
    experts = set((expert_parallel or {}).get("params", []))
    for name in set((sharding or {}).get("params", {})) | set(dims) | experts:
        if name not in pieces[0]:  # another pipeline stage's
            continue
        dim = dims.get(name)
        slice_shape = tp_slice_shape(tp_slice_shape(shapes[name], dim, tp), 0 if name in experts else None, ep)
        slices = []
        for t in range(tp if dim is not None else 1):
            held = []
            for e in range(ep if name in experts else 1):
                group = [pieces[(t * ep + e) * fsdp + f][name] for f in range(fsdp)]
                held.append(unshard(group, slice_shape) if sharding else group[0])
            slices.append(torch.cat(held, 0))
        full[name] = join_tp_slices(slices, dim, tp_fused(tensor_parallel, name)) if dim is not None else slices[0]
    return full
