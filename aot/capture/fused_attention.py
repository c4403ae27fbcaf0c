"""Attention recorded as the runner's fused operator for targets other than the CPU.

torch chooses scaled_dot_product_attention's kernel by the tensors' device when it runs. A step
traced on the build machine's CPU for a GPU target would record the CPU's choice: the CPU's fused
kernel (`_scaled_dot_product_flash_attention_for_cpu`, which a GPU has no kernel for) or, held to
the math backend, bmm-softmax-bmm keeping the B x H x S x S scores for backward (9 GiB a step for
GPT-2 at 16 x 1024) where a GPU runs flash attention and keeps none. `FusedAttention` records
each call it can as `aot::attention` (runner/execution/attention.py), which picks the fused kernel of the
device it runs on, and its backward as `aot::attention_backward`.

A call is recorded so when it has no dropout, no grouped-query broadcasting and no mask that takes
a gradient; under tensor parallelism DTensor runs it on each rank's heads (the sharding rules
registered below). The others keep the math decomposition, which the build's note on attention
scores counts. Under
the target's autocast, SDPA runs in the autocast dtype (CUDA's policy casts its inputs down), so
the inputs are cast here as autocast would: this mode sees the call before autocast does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import runner.execution.attention  # noqa: F401  (registers aot::attention and its backward)


class FusedAttention(TorchFunctionMode):
    """scaled_dot_product_attention recorded as aot::attention where it can be (see the module
    docstring). `cast_to`: the autocast dtype of the target's mixed precision, or None."""

    def __init__(self, cast_to: torch.dtype | None = None):
        super().__init__()
        self.cast_to = cast_to

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = _fusable(*args, **kwargs)
            if call is not None:
                q, k, v, mask, is_causal, scale = call
                if self.cast_to is not None:
                    q, k, v = (t.to(self.cast_to) if t.is_floating_point() else t for t in (q, k, v))
                return torch.ops.aot.attention(q, k, v, mask, is_causal, scale)
        return func(*args, **kwargs)


def _register_sharding() -> None:
    """How DTensor shards the pair under tensor parallelism: by heads (tp's column-wise q, k, v
    projections give each rank whole heads), by batch, or replicated. A mask is split like q where
    it has that dimension of its own (a [B, H, S, S] mask by heads, a [B, 1, S, S] one by batch) and
    is whole on every rank where it broadcasts there (size 1, or a [S, S] mask)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def follows(mask, dim: int):
        if mask is None:
            return None
        own = len(mask.shape) == 4 and mask.shape[dim] != 1
        return Shard(dim) if own else Replicate()

    def strategies(mask, per_head, outputs: int):
        return [
            ([Shard(1)] * outputs, [Shard(1)] * per_head + [follows(mask, 1), None, None]),
            ([Shard(0)] * outputs, [Shard(0)] * per_head + [follows(mask, 0), None, None]),
            ([Replicate()] * outputs, [Replicate()] * per_head + [None if mask is None else Replicate(), None, None]),
        ]

    @register_sharding(torch.ops.aot.attention.default)
    def _(q, k, v, mask, is_causal, scale):
        return strategies(mask, 3, 1)

    @register_sharding(torch.ops.aot.attention_backward.default)
    def _(grad, q, k, v, mask, is_causal, scale):
        return strategies(mask, 4, 3)


_register_sharding()


def _fusable(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """(q, k, v, mask, is_causal, scale) of a call aot::attention computes exactly, else None."""
    from torch.distributed.tensor import DTensor

    tensors = (query, key, value)
    if dropout_p != 0.0 or enable_gqa:
        return None
    if attn_mask is not None and (not isinstance(attn_mask, torch.Tensor) or attn_mask.requires_grad):
        return None
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    if len({isinstance(t, DTensor) for t in (*tensors, *([attn_mask] if attn_mask is not None else []))}) != 1:
        return None  # plain and distributed tensors mixed: DTensor would refuse the call
    if query.dim() != 4 or key.shape[:-1] != value.shape[:-1] or query.shape[:2] != key.shape[:2] or key.shape[-1] != query.shape[-1]:
        return None
    if len({t.dtype for t in tensors}) != 1 or not query.is_floating_point():
        return None
    # torch's default scale, computed as torch does (1 / sqrt(E) in double)
    return query, key, value, attn_mask, bool(is_causal), float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])
