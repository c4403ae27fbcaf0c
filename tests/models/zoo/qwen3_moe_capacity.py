"""tests/models/zoo/qwen3_moe_sgd.py with each rank's experts taking at most CAPACITY_FACTOR x (its
tokens x top-k / experts) token choices, as `aot build --moe-capacity-factor` documents it (first
choices, in token order, before second choices; a choice past the capacity adds nothing). Eager
runs of this file (tests/helpers/ddp_reference.py) compute that rule with plain torch, densely and
independently of aot's dispatch (no gather, no all_to_all: every expert on every token, masked);
aot's build replaces the experts' forward with its own, and tests/test_expert_parallel.py compares
the two."""

import importlib.util
import math
from pathlib import Path

import torch
from torch.nn import functional as F

_spec = importlib.util.spec_from_file_location("aot_zoo_qwen3_moe_sgd", Path(__file__).with_name("qwen3_moe_sgd.py"))
sgd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sgd)

CAPACITY_FACTOR = 1.0
# Under tensor parallelism each tp rank dispatches its own contiguous share of a rank's tokens, and
# the capacity holds per share: tests/models/zoo/qwen3_moe_capacity_tp2.py sets SHARES = 2.
SHARES = 1
batch, loss, optimizer, max_grad_norm = sgd.batch, sgd.loss, sgd.optimizer, sgd.max_grad_norm


def capacity_limited(experts, hidden, top_k_index, top_k_weights):
    shares = [_capacity_limited(experts, h, i, w) for h, i, w in zip(hidden.chunk(SHARES), top_k_index.chunk(SHARES), top_k_weights.chunk(SHARES))]
    return torch.cat(shares)


def _capacity_limited(experts, hidden, top_k_index, top_k_weights):
    """Dense and without reading values (the tp plan traces this forward): every expert runs on
    every token, and a (token, choice) counts only while its expert has taken no more than the
    capacity of choices, counted every first choice in token order, then every second choice."""
    tokens, k = top_k_index.shape
    count = experts.gate_up_proj.shape[0]
    capacity = min(tokens, math.ceil(CAPACITY_FACTOR * tokens * k / count))
    gate, up = torch.einsum("th,eih->eti", hidden, experts.gate_up_proj).chunk(2, dim=-1)
    every = torch.einsum("eti,ehi->eth", experts.act_fn(gate) * up, experts.down_proj)  # [E, T, H]
    routed = F.one_hot(top_k_index, count).transpose(0, 1).reshape(k * tokens, count)  # choice-major
    taken = routed.cumsum(0) * routed  # each (choice, token)'s place in its expert's queue, 0 if not routed there
    kept = ((taken > 0) & (taken <= capacity)).to(hidden.dtype).view(k, tokens, count)
    weight = (kept * top_k_weights.t().unsqueeze(-1)).sum(0)  # [T, E]: the routing weight kept per expert
    return torch.einsum("te,eth->th", weight, every)


def model():
    m = sgd.model()
    for module in m.modules():
        if type(module).__name__.endswith("Experts"):
            module.forward = lambda h, i, w, module=module: capacity_limited(module, h, i, w)
    return m
