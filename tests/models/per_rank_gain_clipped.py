"""tests/models/per_rank_gain.py with its gradients clipped to a global norm. Until the gain's
tp sum is in the graph, each tp rank's norm holds its own part of the gain's gradient, so the
clipping coefficient, and with it every update, differs between the tp ranks: the replica proof
must read the forward's uses of each weight from the forward's values, not from storages the
update writes later (which once made it sum `head`, whose bias it meets, and train wrong)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("per_rank_gain", Path(__file__).with_name("per_rank_gain.py"))
_gain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gain)
model, batch, optimizer, tp_plan = _gain.model, _gain.batch, _gain.optimizer, _gain.tp_plan
max_grad_norm = 0.05
