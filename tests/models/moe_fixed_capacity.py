"""tests/models/zoo/gshard_moe_sgd.py with a fixed capacity of 64 rows per expert: no shape follows
the batch size, so its forward exports to ONNX with a dynamic batch (tests/test_expert_parallel.py
exports its stacked experts under their own names)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("gshard_moe_fixed", Path(__file__).parent / "zoo" / "gshard_moe_sgd.py")
_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_moe)
_moe.CAPACITY = 64
model, batch, loss, optimizer, max_grad_norm = _moe.model, _moe.batch, _moe.loss, _moe.optimizer, _moe.max_grad_norm
