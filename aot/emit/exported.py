"""A traced graph as an ExportedProgram, the form torch's (pickle-free) program schema serializes.

make_fx already gives what torch.export would: ATen ops with a fake value on every node, every
input a user input, every output a user output, in-place updates of inputs kept as in-place ops
(torch.export's training IR). So the graph is wrapped as it is and checked by torch's own
verifier for that IR, which is about 3x faster than having torch.export trace it once more (36 s
of a 77 s build of an 8B-parameter model). Tensor constants (get_attr) are lifted to constant
inputs as torch.export lifts them. A graph the verifier refuses is re-traced by torch.export.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._export.verifier import SpecViolationError, TrainingIRVerifier
from torch.export.exported_program import ExportedProgram, ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

from aot.errors import AotError
from aot.passes.graph_utils import copy_graph


def _fill_missing_values(gm: torch.fx.GraphModule) -> None:
    """Nodes a pass added without a fake value (a bucket's split) get one, computed on the fake
    values of their inputs: the verifier and the serializer need every node's."""
    missing = [n for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta]
    if not missing:
        return
    mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    if mode is None:
        raise SpecViolationError("no fake values to compute missing ones from")
    with mode:
        for node in missing:
            args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
            node.meta["val"] = node.target(*args, **kwargs)


def _lift_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tensor constants the graph reads by get_attr (an init program's `torch.tensor(...)`) made
    inputs of the kind torch.export lifts them to (CONSTANT_TENSOR, stored in the program's
    constants), placed before the graph's own inputs: (name, tensor) by placeholder name."""
    lifted: dict[str, torch.Tensor] = {}
    first = next(iter(gm.graph.nodes), None)
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or not isinstance(getattr(gm, str(node.target), None), torch.Tensor):
            continue
        with gm.graph.inserting_before(first):
            placeholder = gm.graph.placeholder(f"c_{node.target}")
        placeholder.meta.update(node.meta)
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        lifted[placeholder.name] = getattr(gm, str(node.target))
        delattr(gm, str(node.target))
    return lifted


def _wrapped(gm: torch.fx.GraphModule, example_args: list) -> ExportedProgram:
    _fill_missing_values(gm)
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        gm = copy_graph(gm)  # the caller's graph keeps its constants
    constants = _lift_constants(gm)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args)
    if not all(isinstance(o, torch.fx.Node) for o in outputs):
        raise SpecViolationError("an output is not a tensor of the graph")
    signature = ExportGraphSignature(
        [
            InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(n.name), n.name)
            if n.name in constants
            else InputSpec(InputKind.USER_INPUT, TensorArgument(n.name), None)
            for n in inputs
        ],
        [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(n.name), None) for n in outputs],
    )
    calls = ModuleCallSignature(
        inputs=[], outputs=[], in_spec=pytree.tree_flatten((tuple(example_args), {}))[1], out_spec=pytree.tree_flatten(tuple(outputs))[1]
    )
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict={},
        constants={**constants},
        range_constraints={},
        module_call_graph=[ModuleCallEntry("", calls)],
        verifiers=[TrainingIRVerifier],
    )


def exported_program(gm: torch.fx.GraphModule, example_args: list, what: str) -> ExportedProgram:
    """`gm` (traced by make_fx, called with `example_args`) as an ExportedProgram."""
    try:
        return _wrapped(gm, example_args)
    except SpecViolationError:
        pass
    try:
        return torch.export.export(gm, tuple(example_args), strict=False)
    except Exception as e:
        raise AotError(f"{what} could not be exported: {type(e).__name__}: {str(e).splitlines()[0]}") from e
