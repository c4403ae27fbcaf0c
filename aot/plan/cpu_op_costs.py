"""What CPU ops cost called one by one, for the calibration's `compute` entry on CPU ranks.

On one CPU core an op's cost depends on the op: its call (dispatch, argument checks, the loop a
foreach op runs over its tensors) and, for elementwise kernels bound by their arithmetic, a time
per element that no FLOP count gives. These are timed here one op at a time; aot.plan.calibrate
fits what a whole step adds beyond them.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from aot.plan.timing import per_call


def measure_dispatch_seconds(device, gm, args, reps: int = 7) -> dict[str, list[float]]:
    """Op name -> [seconds of one call, seconds each further tensor of a foreach op's list adds]:
    every compute op of the (small) reference step `gm` called on its own, many times in a row,
    with the values the step gives it (on copies: in-place ops leave the step's values alone);
    a foreach op once more on the first tensor of its lists. The median over an op's calls.

    A CPU op's call cost depends on the op far more than on its few bytes: on this machine
    (2026-12-01) a relu on 64 floats takes 3.5 us, an addmm 12 us, a GELU 21 us, an out-of-place
    foreach multiply over 6 tensors 48 us. One per-op cost fitted to a step of Adam and
    attention priced examples/mlp.py's SGD step at 1.30 ms where it runs in 0.89."""
    from torch.fx.node import map_arg
    from torch.utils._pytree import tree_map

    from aot.passes.graph_utils import is_view
    from aot.plan.step_reading import _FREE, _collective_kind, _is_wait, _launches, _target_name

    def copies(value):
        return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)

    env: dict[torch.fx.Node, Any] = {}
    samples: dict[str, list[tuple[float, float]]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = args[len(env)].clone()
            continue
        if node.op != "call_function":
            continue
        a, k = map_arg(node.args, env.__getitem__), map_arg(node.kwargs, env.__getitem__)
        priced = (
            getattr(node.target, "_schema", None) is not None
            and node.target not in _FREE
            and not is_view(node.target)
            and _collective_kind(node) is None
            and not _is_wait(node)
        )
        if priced:
            name = _target_name(node.target)
            ca, ck = copies(a), copies(k)
            full = per_call(lambda: node.target(*ca, **ck), device, reps, inner=20)
            length = _launches(node, name)
            one, per_tensor = full, 0.0
            if length > 1:
                ta = copies([v[:1] if isinstance(v, (list, tuple)) else v for v in a])
                one = per_call(lambda: node.target(*ta, **ck), device, reps, inner=20)
                per_tensor = max(full - one, 0.0) / (length - 1)
            samples.setdefault(name, []).append((one, per_tensor))
        env[node] = node.target(*a, **k)
    table = {name: [statistics.median(o for o, _ in v), statistics.median(p for _, p in v)] for name, v in samples.items()}
    # ops of training steps the reference step lacks (ReLU, SGD's out-of-place foreach updates,
    # embeddings, gradient clipping), each on tiny tensors; a foreach op on lists of 1 and 7
    for name, (op, make) in _dispatch_cases().items():
        if name in table:
            continue
        one = per_call(lambda: op(*make(1)), device, reps, inner=20)
        per_tensor = 0.0
        if name.startswith("_foreach_"):
            seven = make(7)
            per_tensor = max(per_call(lambda: op(*seven), device, reps, inner=20) - one, 0.0) / 6
        table[name] = [one, per_tensor]
    return dict(sorted(table.items()))


def _dispatch_cases():
    """Op name -> (aten op, tensors in a foreach list -> its arguments on tiny tensors)."""
    aten = torch.ops.aten
    x, w, idx = torch.randn(8, 8), torch.randn(16, 8), torch.randint(0, 16, (8,))

    def vecs(n):
        return [torch.randn(64) for _ in range(n)]

    return {
        "relu": (aten.relu.default, lambda n: (x,)),
        "threshold_backward": (aten.threshold_backward.default, lambda n: (x, x, 0)),
        "neg": (aten.neg.default, lambda n: (x,)),
        "reciprocal": (aten.reciprocal.default, lambda n: (x,)),
        "clamp": (aten.clamp.default, lambda n: (x, None, 1.0)),
        "rsub": (aten.rsub.Scalar, lambda n: (x, 1)),
        "mul_": (aten.mul_.Tensor, lambda n: (x, torch.ones(()))),
        "linalg_vector_norm": (aten.linalg_vector_norm.default, lambda n: (x, 2.0)),
        "stack": (aten.stack.default, lambda n: ([torch.ones(()) for _ in range(8)],)),
        "arange": (aten.arange.default, lambda n: (64,)),
        "embedding": (aten.embedding.default, lambda n: (w, idx)),
        "embedding_dense_backward": (aten.embedding_dense_backward.default, lambda n: (x, idx, 16, -1, False)),
        "_foreach_add": (aten._foreach_add.List, lambda n: (vecs(n), vecs(n))),
        "_foreach_mul": (aten._foreach_mul.Tensor, lambda n: (vecs(n), torch.tensor(0.5))),
        "_foreach_sub": (aten._foreach_sub.List, lambda n: (vecs(n), vecs(n))),
        "_foreach_div": (aten._foreach_div.Scalar, lambda n: (vecs(n), 2.0)),
    }


# CPU kernels bound by their arithmetic, not by the bytes they move (FLOP counters give
# elementwise ops no FLOPs): op name as the cost model names graph ops -> (aten op, its arguments
# for an activation x of shape (k, 64, 64), a causal mask of shape (64, 64) and a positive y).
def _elementwise_cases():
    aten = torch.ops.aten
    return {
        "gelu": lambda x, m, y: (aten.gelu.default, (x,)),
        "gelu_backward": lambda x, m, y: (aten.gelu_backward.default, (x, x)),
        "_softmax": lambda x, m, y: (aten._softmax.default, (x, -1, False)),
        "_softmax_backward_data": lambda x, m, y: (aten._softmax_backward_data.default, (x, x, -1, torch.float32)),
        "_log_softmax": lambda x, m, y: (aten._log_softmax.default, (x, -1, False)),
        "_log_softmax_backward_data": lambda x, m, y: (aten._log_softmax_backward_data.default, (x, x, -1, torch.float32)),
        "masked_fill": lambda x, m, y: (aten.masked_fill.Scalar, (x, m, float("-inf"))),
        "where": lambda x, m, y: (aten.where.self, (m, x, y)),
        "pow": lambda x, m, y: (aten.pow.Tensor_Scalar, (x, 2)),
        "exp": lambda x, m, y: (aten.exp.default, (x,)),
        "log": lambda x, m, y: (aten.log.default, (y,)),
        "sqrt": lambda x, m, y: (aten.sqrt.default, (y,)),
        "rsqrt": lambda x, m, y: (aten.rsqrt.default, (y,)),
        "tanh": lambda x, m, y: (aten.tanh.default, (x,)),
        "tanh_backward": lambda x, m, y: (aten.tanh_backward.default, (x, x)),
        "sigmoid": lambda x, m, y: (aten.sigmoid.default, (x,)),
        "silu": lambda x, m, y: (aten.silu.default, (x,)),
        "silu_backward": lambda x, m, y: (aten.silu_backward.default, (x, x)),
        "mul": lambda x, m, y: (aten.mul.Tensor, (x, y)),
        "add": lambda x, m, y: (aten.add.Tensor, (x, y)),
        "sub": lambda x, m, y: (aten.sub.Tensor, (x, y)),
        "div": lambda x, m, y: (aten.div.Tensor, (x, y)),
    }


def measure_element_seconds(device, reps: int = 7) -> dict[str, float]:
    """Seconds per element written of arithmetic-bound elementwise kernels: each run on 16 and
    256 activation slices of 64 x 64 (the difference cancels dispatch), median of `reps`. On this
    machine GELU forward and backward, softmax and a broadcast masked_fill take 2.5-4 ns per
    element on one core, several times what moving their bytes takes; examples/gpt.py's step
    spends about 5 of its 35 ms in them (torch.profiler)."""
    torch.manual_seed(0)
    mask = torch.tril(torch.ones(64, 64, dtype=torch.bool, device=device))
    rates = {}
    for name, case in _elementwise_cases().items():
        seconds = []
        for k in (16, 256):
            x = torch.randn(k, 64, 64, device=device)
            op, args = case(x, mask, x.abs() + 1.0)
            seconds.append((k * 64 * 64, per_call(lambda: op(*args), device, reps, inner=4)))
        (n1, t1), (n2, t2) = seconds
        rates[name] = max(t2 - t1, 0.0) / (n2 - n1)
    return rates


def measure_view_seconds(device, reps: int = 7) -> float:
    """Seconds to dispatch one view (view, t, transpose, expand, as the runner's generated code
    calls them): no data moves, so a view costs less than the ops a reference step fits."""
    aten = torch.ops.aten
    x = torch.randn(8, 64, 32, device=device)
    calls = [
        (aten.view.default, (x, [8, 2048])),
        (aten.t.default, (x[0],)),
        (aten.transpose.int, (x, 1, 2)),
        (aten.expand.default, (x, [2, 8, 64, 32])),
        (aten.unsqueeze.default, (x, 0)),
    ]

    def all_views():
        for op, args in calls:
            op(*args)

    return per_call(all_views, device, reps, inner=200) / len(calls)


def measure_foreach_tensor_seconds(device, reps: int = 7) -> float:
    """Seconds each tensor of a foreach op's list adds on this device: an in-place foreach add
    over 33 small tensors against one (on CPUs foreach loops over its tensors, a kernel each)."""

    def per_list(k: int) -> float:
        xs = [torch.zeros(64, device=device) for _ in range(k)]
        ys = [torch.ones(64, device=device) for _ in range(k)]
        return per_call(lambda: torch._foreach_add_(xs, ys), device, reps, inner=50)

    return max(per_list(33) - per_list(1), 0.0) / 32
