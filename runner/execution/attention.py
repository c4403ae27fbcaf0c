"""Fused attention the runner owns: `aot::attention` and its backward, `aot::attention_backward`.

A GPU artifact is built on any machine, usually one without a GPU, where torch would record
`scaled_dot_product_attention` either as the CPU's fused kernel (which a GPU has no kernel for) or
as its math decomposition (bmm, softmax, bmm), which keeps the B x H x S x S scores for backward:
9 GiB per step for GPT-2 at 16 x 1024, where eager and torch.compile on a GPU run flash attention
and keep none. So the capture records attention as these two operators (aot/capture/
fused_attention.py says when), and each runs, on the device it finds, whatever fused kernel torch
picks there: flash or memory-efficient attention on a GPU, the CPU's flash kernel on CPU ranks
(the kernel eager runs there too, so CPU tests compare against eager exactly).

Every output is contiguous, whatever layout the device's kernel writes: a compiled package (and
the cost model) reads them with the strides the operators' fake kernels declare.

The backward recomputes the forward under autograd and differentiates it, so the pair passes only
q, k, v and the mask (already kept by the step) from forward to backward, through public torch calls alone:
the fused kernels' internal outputs (log-sum-exp, RNG state) differ in shape and type between
devices and torch releases, and an artifact's program must not depend on them. The price is one
more attention forward in backward (torch's flash backward recomputes the scores anyway): about
4% of GPT-2 124M's step FLOPs, priced by the cost model through the FLOP formulas registered below.

A mask (transformers' models pass their causal mask as one when traced) is an input like q, k and
v; it takes no gradient, and on a GPU it makes torch pick memory-efficient attention over flash.
No dropout: the capture keeps the math decomposition for that (the forward's random draws would be
needed again in backward). The module registers the operators on import; a
program using them lists this module in the manifest's `custom_ops`, which the runner imports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count


@torch.library.custom_op("aot::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask [causal]) v, over [batch, heads, sequence, head dim] tensors;
    `mask` as scaled_dot_product_attention's attn_mask (bool: where to attend; float: added)."""
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale).contiguous()


@attention.register_fake
def _(q, k, v, mask, is_causal, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("aot::attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `attention(q, k, v)` for the gradient `grad` of its output."""
    with _autograd_inside_an_operator(), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def _autograd_inside_an_operator():
    """Autograd back on inside an operator's kernel: torch runs a custom operator's kernel below
    autograd (its dispatch keys excluded), where differentiating the recomputed forward would find
    no graph to differentiate."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@attention_backward.register_fake
def _(grad, q, k, v, mask, is_causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad, q, k, v, mask, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)


# The cost model prices ops by torch's FLOP counter; these make the pair matmul-like ops there.
@register_flop_formula(torch.ops.aot.attention)
def _attention_flops(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.aot.attention_backward)
def _attention_backward_flops(grad_shape, q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    # the recomputed forward, then the backward proper
    return sdpa_flop_count(q_shape, k_shape, v_shape) + sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)
