"""Helpers of the inference and custom-operator tests: eager references built without aot."""

from __future__ import annotations

import importlib.util
import subprocess

import torch

from helpers.commands import show


def load_user(path):
    """A model file imported with importlib, as plain Python (not through aot)."""
    spec = importlib.util.spec_from_file_location(f"reference_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eager_model(user, state_dict=None, seed=0):
    """`torch.manual_seed(seed); model()` in eval mode, with `state_dict` loaded if given."""
    torch.manual_seed(seed)
    model = user.model()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def assert_user_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 1, no traceback, the last line is the only `aot: error:` line and names the problem."""
    assert r.returncode == 1, show(r)
    assert "Traceback" not in r.stderr + r.stdout, show(r)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("aot: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], show(r)
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in the error line\n{show(r)}"
    return errors[0]
