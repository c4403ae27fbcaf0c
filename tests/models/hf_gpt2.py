"""transformers' GPT2LMHeadModel, tiny: Conv1D layers (weights stored (in, out)) and the fused
q/k/v projection `c_attn` whose output the attention splits in three. Dropout off. The model zoo's
gpt2 (tests/models/zoo/families.py holds its config)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_zoo_families", Path(__file__).parent / "zoo" / "families.py")
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

model, batch, loss = zoo.model_file("gpt2")
