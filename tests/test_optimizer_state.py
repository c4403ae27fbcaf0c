"""The optimizer state the build and the planner record on fake parameters: torch.optim's own
optimizers stepped over one parameter of each layout (aot.capture.training_state.PER_PARAMETER_STATE)
give every parameter the state torch's full step gives it."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from aot.capture.graph_reading import storage_key
from aot.capture.training_state import PER_PARAMETER_STATE, _init_optimizer_state, _stepped_once

SETTINGS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 1e-3}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.5}),
    (torch.optim.Adadelta, {}),
    (torch.optim.Adamax, {}),
    (torch.optim.NAdam, {"decoupled_weight_decay": True}),
    (torch.optim.RAdam, {}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}),
]


def _params(mode: FakeTensorMode) -> list[torch.nn.Parameter]:
    """Parameters of a few layouts, most of them repeated as a model's blocks repeat them: two
    dtypes, a transposed (non-contiguous) weight, a 0-d scale."""
    with mode:
        made = []
        for _ in range(3):
            made += [
                torch.nn.Parameter(torch.empty(8, 4)),
                torch.nn.Parameter(torch.empty(4)),
                torch.nn.Parameter(torch.empty(5, 3).t()),
                torch.nn.Parameter(torch.empty(6, dtype=torch.bfloat16)),
            ]
        made.append(torch.nn.Parameter(torch.empty(())))
    return made


def _state(opt_class, settings: dict, stepped_over_layouts: bool) -> list[list[tuple]]:
    """Each parameter's state, as (key, shape, strides, dtype, device, storage offset) in order,
    and whether any two state tensors share a storage."""
    mode = FakeTensorMode()
    params = _params(mode)
    # two groups with settings of their own (weight decay differs, the rest as `settings`)
    groups = [{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.01}]
    with mode:
        opt = opt_class(groups, **settings)
        _init_optimizer_state(opt) if stepped_over_layouts else _stepped_once(opt, fake=True)
    keys = [storage_key(v) for p in params for v in opt.state[p].values()]
    assert len(set(keys)) == len(keys), "two state tensors share a storage"
    out = [[(k, tuple(v.shape), v.stride(), v.dtype, v.device.type, v.storage_offset()) for k, v in sorted(opt.state[p].items())] for p in params]
    assert [g["params"] for g in opt.param_groups] == [groups[0]["params"], groups[1]["params"]]  # put back
    return out


@pytest.mark.parametrize("opt_class,settings", SETTINGS, ids=lambda v: v.__name__ if isinstance(v, type) else ",".join(v) or "defaults")
def test_state_made_from_one_parameter_of_each_layout_is_the_full_steps(opt_class, settings):
    assert opt_class in PER_PARAMETER_STATE
    full = _state(opt_class, settings, stepped_over_layouts=False)
    assert all(full), f"{opt_class.__name__} made no state"
    assert _state(opt_class, settings, stepped_over_layouts=True) == full


def test_a_subclass_is_stepped_over_every_parameter():
    """A subclass of a torch.optim optimizer may keep state across parameters: it gets the full step."""
    seen = []

    class Counting(torch.optim.AdamW):
        def step(self, closure=None):
            seen.append(sum(len(g["params"]) for g in self.param_groups))
            return super().step(closure)

    mode = FakeTensorMode()
    params = _params(mode)
    with mode:
        _init_optimizer_state(Counting(params, lr=1e-3))
    assert seen == [len(params)]
