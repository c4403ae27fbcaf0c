"""Bad model file for tests/test_bad_input.py: tests/models/zoo/titan_llama.py with its blocks under
the reentrant torch.utils.checkpoint, which reruns the forward inside its own autograd.Function."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("aot_test_titan_llama_reentrant", Path(__file__).parent / "zoo" / "titan_llama.py")
titan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(titan)
titan.CHECKPOINT = "reentrant"

model, batch, loss, optimizer = titan.model, titan.batch, titan.loss, titan.optimizer
