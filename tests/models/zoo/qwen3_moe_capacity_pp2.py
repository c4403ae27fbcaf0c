"""tests/models/zoo/qwen3_moe_capacity.py as `--strategy pp=2,ep=2 --moe-capacity-factor 1` computes
it: the pipeline dispatches each of a rank's two microbatches (its first and second half of the
samples, so of the tokens) on its own, with the capacity of a microbatch (eager runs of this file
compute that rule in plain torch)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_zoo_qwen3_moe_capacity", Path(__file__).with_name("qwen3_moe_capacity.py"))
capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capacity)
capacity.SHARES = 2

model, batch, loss, optimizer, max_grad_norm = capacity.model, capacity.batch, capacity.loss, capacity.optimizer, capacity.max_grad_norm
