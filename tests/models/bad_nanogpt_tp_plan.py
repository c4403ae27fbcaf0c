"""Bad model file for tests/test_model_code.py: nanoGPT (tests/models/zoo/nanogpt.py) with a tp_plan
that splits its attention, whose forward fixes the head count (`view(B, T, self.n_head, ...)`)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_test_nanogpt_tp_plan", Path(__file__).parent / "zoo" / "nanogpt.py")
nanogpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nanogpt)

model, batch, loss, optimizer = nanogpt.model, nanogpt.batch, nanogpt.loss, nanogpt.optimizer
tp_plan = {f"transformer.h.{i}.attn.c_attn": "colwise:3" for i in range(2)} | {f"transformer.h.{i}.attn.c_proj": "rowwise" for i in range(2)}
