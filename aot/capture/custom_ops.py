"""Custom operators in a captured graph, and the modules the runner must import to resolve them.

A model may call operators defined with `torch.library.custom_op` (with `register_fake`, so they
trace on fake tensors, and `register_autograd`, so they train). The program names them by
`namespace::name`, which torch resolves only after the module registering them is imported. The
runner never imports the model file, so that module must be a separate, importable op library.

Which modules: those the model file lists in `custom_op_modules`, plus, for every custom
operator found in the graph that was defined with `torch.library.custom_op`, the module its
definition lives in. An operator registered another way (a C++ extension, `torch.library.Library`)
cannot be traced back to a module: the model file must then name its module in
`custom_op_modules`. An operator defined inside the model file itself is refused.
"""

from __future__ import annotations

import importlib

import torch

from aot.capture.model_file import ModelFile
from aot.errors import AotError
from runner.execution import init_ops

# Namespaces of operators that torch itself registers; anything else is a custom operator.
TORCH_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "rngprims",
        "_c10d_functional",
        "_c10d_functional_autograd",
        "c10d",
        "c10d_functional",
        "_dtensor",
        "profiler",
        "quantized_decomposed",
        "quantized",
        "_quantized",
        "_prims",
        "debugprims",
        "_inductor_test",
        "inductor",
        "_test",
        "higher_order",
        "onnx",
        init_ops.NAMESPACE,  # the runner's own init ops (runner/execution/init_ops.py), registered by the runner itself
    }
)


def custom_ops_in(graph: torch.fx.Graph) -> list[str]:
    """Qualified names (`namespace::name`) of the custom operators a graph calls, sorted."""
    found = set()
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace not in TORCH_NAMESPACES:
            found.add(target._schema.name)
    return sorted(found)


def defining_module(qualname: str) -> str | None:
    """The module whose `torch.library.custom_op` defined `qualname`, if it was defined so."""
    opdef = torch._library.custom_ops.OPDEFS.get(qualname)
    fn = getattr(opdef, "_init_fn", None)
    return getattr(fn, "__module__", None)


def custom_op_spec(mf: ModelFile, graphs) -> dict | None:
    """The manifest's `custom_ops` entry (`ops`, `modules`) for the captured graph(s), or None
    when no graph calls a custom operator and the model file names no op library."""
    graphs = [graphs] if isinstance(graphs, torch.fx.Graph) else list(graphs)
    ops = sorted({op for graph in graphs for op in custom_ops_in(graph)})
    modules = list(mf.custom_op_modules)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:
            raise AotError(
                f"{mf.path.name}: custom_op_modules names {name!r}, which cannot be imported "
                f"({type(e).__name__}: {e}); the runner imports it by this name, so it must be importable "
                f"(installed, or on PYTHONPATH)"
            ) from None
    for op in ops:
        module = defining_module(op)
        if module is None:
            if not modules:
                raise AotError(
                    f"{mf.path.name}: the step calls custom operator {op}, which was not defined with "
                    f"torch.library.custom_op; name the module that registers it in custom_op_modules"
                )
            continue  # trusted to come from one of the listed modules; the runner checks it resolves
        if module == mf.module_name or module == "__main__":
            raise AotError(
                f"{mf.path.name}: custom operator {op} is defined in the model file itself, which the "
                f"runner never imports; move it into its own module (see examples/custom_ops.py)"
            )
        if module not in modules:
            modules.append(module)
    if not ops and not modules:
        return None
    return {"ops": ops, "modules": modules}
