"""Bad model file for tests/test_expert_parallel.py: the GShard-style mixture of experts of
tests/models/zoo/gshard_moe_sgd.py trained by the user's own layer-wise optimizer (LARS: each
tensor's step scaled by the ratio of its weight's norm to its gradient's). `--strategy ep=N` stacks
a ModuleList's experts into one weight per parameter, which would give the experts one ratio
instead of one each, so it is refused in one line."""

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("gshard_moe", Path(__file__).parent / "zoo" / "gshard_moe_sgd.py")
_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_moe)
model, batch, loss = _moe.model, _moe.batch, _moe.loss


class LARS(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(p.norm() / (p.grad.norm() + 1e-9))
        return super().step()


def optimizer(params):
    return LARS(params, lr=0.01)
