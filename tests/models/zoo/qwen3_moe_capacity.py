"""tests/models/zoo/qwen3_moe_sgd.py with each rank's experts taking at most CAPACITY_FACTOR x (its
tokens x top-k / experts) token choices, as `aot build --moe-capacity-factor` documents it (first
choices, in token order, before second choices; a choice past the capacity adds nothing). Eager
runs of this file (tests/helpers/ddp_reference.py) compute that rule with plain torch, written here
independently of aot's dispatch; aot's build replaces the experts' forward with its own, and
tests/test_expert_parallel.py compares the two."""

import importlib.util
import math
from pathlib import Path

import torch
from torch.nn import functional as F

_spec = importlib.util.spec_from_file_location("aot_zoo_qwen3_moe_sgd", Path(__file__).with_name("qwen3_moe_sgd.py"))
sgd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sgd)

CAPACITY_FACTOR = 1.0
batch, loss, optimizer, max_grad_norm = sgd.batch, sgd.loss, sgd.optimizer, sgd.max_grad_norm


def capacity_limited(experts, hidden, top_k_index, top_k_weights):
    tokens, k = top_k_index.shape
    count = experts.gate_up_proj.shape[0]
    capacity = min(tokens, math.ceil(CAPACITY_FACTOR * tokens * k / count))
    out = torch.zeros_like(hidden)
    for e in range(count):
        taken = 0
        for choice in range(k):  # every first choice before any second choice
            for t in range(tokens):
                if int(top_k_index[t, choice]) != e:
                    continue
                taken += 1
                if taken > capacity:
                    continue
                gate, up = F.linear(hidden[t], experts.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
                out[t] = out[t] + y * top_k_weights[t, choice]
    return out


def model():
    m = sgd.model()
    for module in m.modules():
        if type(module).__name__.endswith("Experts"):
            module.forward = lambda h, i, w, module=module: capacity_limited(module, h, i, w)
    return m
