"""Loading a user's model.py and checking it against the model-file contract.

Required: `model() -> nn.Module` and `batch(batch_size) -> (inputs, targets)`.
Optional: `loss(outputs, targets)`, `optimizer(params)`, `scheduler(optimizer)`, `max_grad_norm`,
`custom_op_modules` (modules that register custom operators; see aot/capture/custom_ops.py) and
`onnx_translations` (custom operator -> ONNX translation; see aot/emit/onnx_export.py) and
`tp_plan` (module name -> "colwise" | "rowwise" | "colwise:K"; see aot/plan/tensor_parallel.py).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from aot.errors import AotError
from runner.format.integrity import sha256_file


def default_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension, any leading dimensions flattened."""
    return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))


def default_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass(frozen=True)
class ModelFile:
    path: Path
    sha256: str
    model: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple]
    loss: Callable
    optimizer: Callable
    scheduler: Callable | None
    max_grad_norm: float | None
    custom_op_modules: tuple[str, ...] = ()
    onnx_translations: dict | Callable[[], object] | None = None  # a dict, or a function returning one (read only when exporting)
    module_name: str = ""  # the name the model file was imported under
    tp_plan: object = None  # module name -> "colwise" | "rowwise" | "colwise:K" (see aot/plan/tensor_parallel.py)
    globals: dict = field(default_factory=dict)  # the model file's other module-level names (head counts, say)

    def example_batch(self, rows: int) -> dict[str, torch.Tensor]:
        """The user's batch(rows) as the safetensors mapping the runner reads (`inputs`, `targets`).
        torch's global generator is seeded (0) for the call, and restored after: a batch() drawing
        with torch.randint and no generator of its own (transformers-style examples) gives the same
        tokens in every build, so two builds stay byte-identical."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            result = call_user(self.batch, f"batch({rows})", self.path, rows)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise AotError(f"{self.path.name}: batch(batch_size) must return (inputs, targets)")
        inputs, targets = result
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        tensors = {"targets": targets, **({"inputs": inputs[0]} if len(inputs) == 1 else {f"inputs.{i}": t for i, t in enumerate(inputs)})}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise AotError(f"{self.path.name}: batch() returned a {type(t).__name__} for {name}; expected tensors")
            if t.dim() == 0 or t.shape[0] != rows:
                raise AotError(f"{self.path.name}: batch({rows}) returned {name} with {t.shape[0] if t.dim() else 0} samples, expected {rows}")
        # each its own contiguous memory: a batch may hand the same tensor (or two views of one:
        # ids[:, :-1], ids[:, 1:]) as an input and as the targets (nanoGPT's model(X, Y)), and the
        # stored batch is a safetensors file, one tensor per name
        return {name: t.detach().clone(memory_format=torch.contiguous_format) for name, t in tensors.items()}


# Where torch, aot, the runner and Python's own library live: frames there are not model code
_AOT_DIR = Path(__file__).resolve().parents[1]
_TOOL_DIRS = tuple(f"{d}/" for d in (Path(torch.__file__).resolve().parent, _AOT_DIR, _AOT_DIR.parent / "runner"))
_STDLIB_DIR = str(Path(traceback.__file__).resolve().parent) + "/"


def is_model_code(filename: str) -> bool:
    if filename.startswith("<"):  # generated code (FX's forward, exec'd strings)
        return False
    resolved = str(Path(filename).resolve())
    if resolved.startswith(_TOOL_DIRS):
        return False
    return "-packages/" in resolved or not resolved.startswith(_STDLIB_DIR)  # installed packages (transformers) are model code


def code_frame(exc: BaseException, path: Path) -> traceback.FrameSummary | None:
    """The line of model code an exception came from: the innermost frame in the model file, else
    the innermost in any other model code (a module the model file imports, transformers'
    modeling code), never torch's, aot's or the standard library's."""
    frames = traceback.extract_tb(exc.__traceback__)
    found = [f for f in frames if Path(f.filename) == path] or [f for f in frames if is_model_code(f.filename)]
    return found[-1] if found else None


def calling_line() -> str:
    """'model.py:12: ' for the innermost frame of model code on the current stack ('' if none): where
    model code called into torch when an AotError is raised from inside torch's call."""
    frame = next((f for f in reversed(traceback.extract_stack()) if is_model_code(f.filename)), None)
    return f"{Path(frame.filename).name}:{frame.lineno}: " if frame is not None else ""


def reads_values(exc: BaseException) -> bool:
    """Whether tracing failed because the code needs a tensor's value (torch's DataDependent errors)."""
    return any("DataDependent" in type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None)


# What to do instead of reading a tensor's value while the step is traced
STEP_READS_VALUES = "compute both sides and choose with torch.where, or decide outside the model (a model-file setting)"


def describe_error(exc: BaseException, path: Path, reading_values: str = STEP_READS_VALUES) -> str:
    """torch's exception from tracing model code as one line a user reads: where in their code
    first, then what; a value read (a branch on a tensor) said in words, not torch's guard jargon,
    followed by `reading_values`, what to do instead."""
    frame = code_frame(exc, path)
    where = f"{Path(frame.filename).name}:{frame.lineno} ({(frame.line or '').strip()})" if frame is not None else ""
    if reads_values(exc):
        return (
            f"{where or 'the model'} reads a tensor's value (a data-dependent branch, .item(), .tolist(), or a shape "
            f"that depends on values), which one static graph cannot hold; {reading_values}"
        )
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""  # one line: torch's can run to ten
    return f"{type(exc).__name__}: {message}" + (f" at {where}" if where else "")


def call_user(fn: Callable, what: str, path: Path, *args, reading_values: str = STEP_READS_VALUES):
    """Call a model-file function; its exceptions become one line naming the file and line
    (`reading_values`: what to do instead where the function read a traced tensor's value)."""
    try:
        return fn(*args)
    except AotError:
        raise
    except Exception as e:
        described = describe_error(e, path, reading_values)
        raise AotError(f"{path.name}: {what}" + (f": {described}" if reads_values(e) else f" raised {described}")) from e


def load_model_file(path: str | Path) -> ModelFile:
    path = Path(path).resolve()
    if not path.is_file():
        raise AotError(f"{path}: no such model file")
    spec = importlib.util.spec_from_file_location(f"aot_user_model_{path.stem}", path)
    if spec is None:  # no import machinery takes a file of this suffix (model.txt, model)
        raise AotError(f"{path.name}: Python cannot import this file; a model file's name ends in .py")
    # a spec made from a file location carries the loader that reads the file
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the model file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise AotError(f"{path.name}:{e.lineno}: syntax error: {e.msg}") from e
    except Exception as e:
        raise AotError(f"{path.name}: importing it raised {describe_error(e, path)}") from e
    finally:
        sys.path.remove(str(path.parent))

    def function(name: str, required: bool):
        fn = getattr(module, name, None)
        if fn is None and required:
            raise AotError(f"{path.name}: defines no {name}() (required by the model-file contract, see README)")
        if fn is not None and not callable(fn):
            raise AotError(f"{path.name}: {name} must be a function, got {type(fn).__name__}")
        return fn

    max_grad_norm = getattr(module, "max_grad_norm", None)
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or max_grad_norm <= 0):
        raise AotError(f"{path.name}: max_grad_norm must be a positive number, got {max_grad_norm!r}")
    custom_op_modules = getattr(module, "custom_op_modules", ())
    if isinstance(custom_op_modules, str) or not isinstance(custom_op_modules, (list, tuple)) or not all(isinstance(m, str) and m for m in custom_op_modules):
        raise AotError(f"{path.name}: custom_op_modules must be a list of module names, got {custom_op_modules!r}")
    onnx_translations = getattr(module, "onnx_translations", None)
    if onnx_translations is not None and not (isinstance(onnx_translations, dict) or callable(onnx_translations)):
        raise AotError(f"{path.name}: onnx_translations must be a dict (or a function returning one), got {type(onnx_translations).__name__}")
    return ModelFile(
        path=path,
        sha256=sha256_file(path),
        model=function("model", True),
        batch=function("batch", True),
        loss=function("loss", False) or default_loss,
        optimizer=function("optimizer", False) or default_optimizer,
        scheduler=function("scheduler", False),
        max_grad_norm=float(max_grad_norm) if max_grad_norm is not None else None,
        custom_op_modules=tuple(custom_op_modules),
        onnx_translations=onnx_translations,
        module_name=spec.name,
        tp_plan=getattr(module, "tp_plan", None),
        globals={k: v for k, v in vars(module).items() if not k.startswith("_")},
    )
