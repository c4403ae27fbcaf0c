"""transformers' Mixtral at the zoo's tiny size (4 experts, top 2), trained by SGD with clipping, as
tests/models/zoo/qwen3_moe_sgd.py: Mixtral's router renormalizes its top-k weights and hands them
to the experts in fp32, where Qwen3-MoE's casts them back. Expert parallelism's tests train it."""

import importlib.util
from pathlib import Path

import torch
import transformers

_spec = importlib.util.spec_from_file_location("aot_zoo_families", Path(__file__).with_name("families.py"))
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

model, batch, loss = zoo.hf.causal_lm(transformers.MixtralConfig(**zoo.LLAMA, num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0))
max_grad_norm = 0.5


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)
