"""aot/passes/repeated_backward.py: a backward differentiated twice (zero-bubble's input and
weight gradients) computes the shared activation gradients once, and the same numbers."""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from aot.capture.pipeline import WEIGHT_GRADIENT
from aot.passes.repeated_backward import merge_repeated_backward

torch.manual_seed(0)
W1, W2 = torch.randn(8, 8), torch.randn(8, 8)
GAMMA, BETA = torch.randn(8), torch.randn(8)


def _stage(x, w1, w2, gamma, beta):
    h = torch.nn.functional.layer_norm(torch.relu(x @ w1), (8,), gamma, beta)
    return (h @ w2).tanh()


def _split(x, w1, w2, gamma, beta, seed):
    """Input gradient first (graph kept), weight gradients after, tagged as zero-bubble's W."""
    out = _stage(x, w1, w2, gamma, beta)
    (dx,) = torch.autograd.grad(out, [x], seed, retain_graph=True)
    with fx_traceback.annotate({WEIGHT_GRADIENT: True}):
        dws = torch.autograd.grad(out, [w1, w2, gamma, beta], seed)
    return (dx, *dws)


def _whole(x, w1, w2, gamma, beta, seed):
    out = _stage(x, w1, w2, gamma, beta)
    return torch.autograd.grad(out, [x, w1, w2, gamma, beta], seed)


def _args():
    x = torch.randn(4, 8, requires_grad=True)
    return [x, *(t.clone().requires_grad_(True) for t in (W1, W2, GAMMA, BETA)), torch.randn(4, 8)]


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_the_weight_pass_reads_the_input_passs_activation_gradients():
    with fx_traceback.preserve_node_meta():
        split = make_fx(_split)(*_args())
    whole = make_fx(_whole)(*_args())
    before = _ops(split)
    assert before["aten.mm.default"] > _ops(whole)["aten.mm.default"]  # the second pass recomputed the chain
    assert merge_repeated_backward(split) is split
    after = _ops(split)
    assert after["aten.mm.default"] == _ops(whole)["aten.mm.default"]  # each matmul once, as one backward
    # layer norm's backward: the input's gradient from the first pass, the weight's and bias's from the second
    masks = [n.args[-1] for n in split.graph.nodes if n.target == torch.ops.aten.native_layer_norm_backward.default]
    assert sorted(map(list, masks)) == [[False, True, True], [True, False, False]]
    args = _args()
    ours, reference = split(*args), _whole(*args)
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))


def test_untagged_repeats_and_values_written_in_place_are_left_alone():
    def step(x, w):
        a = x @ w
        b = x @ w  # a repeat outside a weight-gradient pass: not this pass's business
        with fx_traceback.annotate({WEIGHT_GRADIENT: True}):
            c = x @ w
        a.add_(1)  # the earlier result changes after the tagged repeat: sharing it would be wrong
        return a, b, c

    with fx_traceback.preserve_node_meta():
        gm = make_fx(step)(torch.randn(2, 2), torch.randn(2, 2))
    merge_repeated_backward(gm)
    assert _ops(gm)["aten.mm.default"] == 3
