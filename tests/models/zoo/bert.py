"""Model zoo: transformers' bert at a tiny size (tests/models/zoo/families.py)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_zoo_families", Path(__file__).with_name("families.py"))
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

model, batch, loss = zoo.model_file("bert")
