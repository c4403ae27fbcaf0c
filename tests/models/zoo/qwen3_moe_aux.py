"""tests/models/zoo/qwen3_moe_sgd.py trained on its loss plus transformers' load-balancing loss
(`output_router_logits=True`, `router_aux_loss_coef` 0.01, computed from each rank's own router
logits as the model computes it), so the router's gradient carries it: expert parallelism keeps
it as eager DDP computes it, per rank (tests/test_expert_parallel.py)."""

import importlib.util
from pathlib import Path

import torch
import transformers
from torch.nn import functional as F

_spec = importlib.util.spec_from_file_location("aot_zoo_qwen3_moe_sgd", Path(__file__).with_name("qwen3_moe_sgd.py"))
sgd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sgd)
zoo = sgd.zoo

batch, optimizer, max_grad_norm = sgd.batch, sgd.optimizer, sgd.max_grad_norm
CONFIG = transformers.Qwen3MoeConfig(
    **zoo.LLAMA, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True, router_aux_loss_coef=0.01
)


class WithAux(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(CONFIG)

    def forward(self, ids):
        out = self.model(input_ids=ids, use_cache=False, labels=ids)  # labels only switch the aux loss on
        return out.logits, out.aux_loss


def model():
    return WithAux()


def loss(outputs, targets):
    logits, aux = outputs
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) + CONFIG.router_aux_loss_coef * aux
