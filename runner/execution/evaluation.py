"""The validation loss: the artifact's eval program (forward and loss in eval mode, no backward,
no optimizer; artifacts/FORMAT.md, "Eval program") run on a trainer's live weights.

`val_loss` is the mean over K batches of the program's `global_loss` (each already the mean over
the data-parallel ranks). Batch k is the data's global batch k in file order, never shuffled, so
every evaluation of a run, and `aot eval` of its checkpoint, reads the same samples.
"""

from __future__ import annotations

import torch

from runner.errors import AotError
from runner.execution.data import DataSource
from runner.execution.graph_loader import input_shapes, load_portable, wait_at_issue
from runner.execution.p2p import forget_waits

NO_EVAL_PROGRAM = "has no eval program (it was built before aot wrote one); rebuild it with this aot to evaluate"


class Evaluator:
    """One rank's eval program, bound to `trainer`'s weights (the tensors training updates in place,
    so each evaluation reads the weights of that moment)."""

    def __init__(self, trainer):
        artifact = trainer.artifact
        name = artifact.rank(trainer.rank).get("eval_program")
        if name is None:
            raise AotError(f"{artifact.root}: this artifact {NO_EVAL_PROGRAM}")
        program = artifact.program(name)
        program_json = artifact.read(program["file"])
        self._module, _ = load_portable(artifact, program, trainer.device, program_json)
        if trainer.on_gloo():
            wait_at_issue(self._module)  # gloo: one collective in flight at a time (graph_loader.wait_at_issue)
        self._trainer = trainer
        self._slots = program["inputs"]
        shapes = input_shapes(program_json)
        for index, slot in enumerate(self._slots):
            if slot["kind"] not in ("param", "buffer"):
                continue
            tensor = trainer.weights.get(slot["name"])
            if tensor is None:
                raise AotError(f"{artifact.root}/manifest.json: the eval program takes {slot['kind']} {slot['name']!r}, which this rank does not hold")
            if shapes is not None and shapes[index] is not None and list(tensor.shape) != shapes[index]:
                raise AotError(
                    f"{artifact.root}: the eval program takes {slot['kind']} {slot['name']} of shape {shapes[index]}, the rank holds {list(tensor.shape)}"
                )

    def loss(self, source: DataSource, batches: int) -> float:
        """The mean global loss over the first `batches` global batches of `source` (every rank
        calls it: the program averages over the data-parallel ranks)."""
        trainer = self._trainer
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for k in range(batches):
                inputs, targets = source.batch(k)
                given = iter(inputs)
                args = []
                for slot in self._slots:
                    kind = slot["kind"]
                    if kind in ("param", "buffer"):
                        args.append(trainer.weights[slot["name"]])
                    elif kind == "input":
                        args.append(trainer.check_input(next(given, None), slot, f"eval inputs[{slot['index']}]"))
                    else:
                        args.append(trainer.check_input(targets, slot, "eval targets"))
                forget_waits()  # a pipeline's transfers named in a failure are this run's (runner/execution/p2p.py)
                try:
                    outputs = self._module(*args)
                except RuntimeError as e:
                    raise trainer.stuck_error(e) from e
                total += outputs[1].detach().double().cpu()
        return float(total / batches)
