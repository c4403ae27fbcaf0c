"""A tensor-parallel plan tried before it is used: the forward run with the plan's layers split.

The finder (aot/plan/tensor_parallel.py) reads its pairs from the exported forward graph, whose
shapes are numbers: it cannot tell `view(B, T, self.n_head, hs)` (a head count fixed in the code,
which a rank's share of the heads cannot take: nanoGPT's attention) from `view(B, T, -1, hs)`.
Running the forward split, on fake tensors over a fake process group as the step is traced, tells
them apart, and names the module and the line of model code that failed.
"""

from __future__ import annotations

import contextlib
import linecache
from pathlib import Path

import torch
from torch import nn

from aot.capture.model_file import is_model_code
from aot.capture.step import traced_as_compiled
from aot.capture.tensor_parallel import tensor_parallel
from aot.capture.trace_logs import quiet_trace_logs
from aot.errors import AotError
from aot.plan.tensor_parallel_summary import summarize


def split_forward_failure(model: nn.Module, plan: dict[str, str], inputs: list[torch.Tensor], size: int) -> tuple[str, str] | None:
    """Run the forward with `plan`'s layers split over `size` ranks (rank 0; fake tensors, a fake
    process group): None where it runs, else (the module whose forward failed: the innermost
    holding split layers, its forward's line, what failed)."""
    if not plan:
        return None
    fake_mode = torch._guards.detect_fake_mode([*model.parameters()])  # the build's model lives on fake tensors
    with tensor_parallel(model, plan, size, "aot.tp_trial") as tp:
        names = {id(m): name for name, m in tp.model.named_modules()}
        try:
            with fake_mode or contextlib.nullcontext(), traced_as_compiled(), quiet_trace_logs():  # as the step is traced (aot.capture.step)
                tp.model(*[fake_mode.from_tensor(t) if fake_mode else t for t in inputs])
            return None
        except Exception as e:
            failed, error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            tb = e.__traceback__
            while tb is not None:  # outermost to innermost: the innermost module's forward in model code
                owner = names.get(id(tb.tb_frame.f_locals.get("self")))
                if owner is not None and is_model_code(tb.tb_frame.f_code.co_filename):
                    failed = (owner, tb.tb_frame.f_code.co_filename, tb.tb_lineno)
                tb = tb.tb_next
            if failed is None or not any(n.startswith(f"{failed[0]}.") for n in plan):
                # not inside a module with split layers: not a size the split changed
                raise AotError(f"tensor parallel: the forward fails with {summarize(list(plan))} split ({error}); give a tp_plan in the model file") from e
    owner, filename, line = failed
    code = linecache.getline(filename, line).strip()
    return owner, (
        f"its forward fails with the layers split at {Path(filename).name}:{line} ({code}; {error}): a size fixed in the code "
        f"(a head count, a width) that a rank's 1/tp share of the features cannot take; compute it from the tensor "
        f"(view(B, T, -1, head_dim)) so tp can split it"
    )
