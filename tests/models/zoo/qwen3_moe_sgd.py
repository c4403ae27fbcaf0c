"""transformers' qwen3_moe at the zoo's tiny size, trained by SGD with clipping: every gradient's
scale shows in the weights (Adam's update would hide a gradient off by a constant factor), and the
global norm clips, so a gradient counted on the wrong ranks shows too. Expert parallelism's tests
(tests/test_expert_parallel.py) train it."""

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("aot_zoo_families", Path(__file__).with_name("families.py"))
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

model, batch, loss = zoo.model_file("qwen3_moe")
max_grad_norm = 0.5


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)
