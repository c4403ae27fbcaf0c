"""A fast path from a serialized program (torch's export schema JSON) to a runnable FX graph.

torch's deserializer rebuilds a whole ExportedProgram: it imports torch._dynamo and re-creates a
fake tensor for every node, which at start-up costs seconds that a runner should not pay. Our
programs are plain: every input is a user input, every output a user output, and every node a
call of a `torch.ops` operator. For those this module builds the FX graph directly from the
JSON (the same schema, read the same way) and lets FX generate its Python code. Tensors the
export lifted out of the graph (an init program's `torch.tensor(...)` constants, stored in the
program's constants file) become attributes of the module, as torch's own `.module()` makes them.
Anything else (higher-order ops, symbolic shapes) returns None, and the caller uses torch's
deserializer instead. tests/test_program_loader.py checks both paths give bit-identical results.
"""

from __future__ import annotations

import json
import operator

import torch

from runner.execution.p2p import is_point_to_point

# ScalarType, MemoryFormat and Layout numbers of torch._export.serde.schema (the stored format)
_DTYPES = {
    1: torch.uint8,
    2: torch.int8,
    3: torch.int16,
    4: torch.int32,
    5: torch.int64,
    6: torch.float16,
    7: torch.float32,
    8: torch.float64,
    9: torch.complex32,
    10: torch.complex64,
    11: torch.complex128,
    12: torch.bool,
    13: torch.bfloat16,
    28: torch.uint16,
    29: torch.float8_e4m3fn,
    30: torch.float8_e5m2,
    31: torch.float8_e4m3fnuz,
    32: torch.float8_e5m2fnuz,
    34: torch.uint32,
    35: torch.uint64,
}
_MEMORY_FORMATS = {1: torch.contiguous_format, 2: torch.channels_last, 3: torch.channels_last_3d, 4: torch.preserve_format}
_LAYOUTS = {7: torch.strided}
_LITERALS = ("as_int", "as_float", "as_bool", "as_string", "as_ints", "as_floats", "as_bools", "as_strings")


class Unsupported(Exception):
    """The program needs torch's full deserializer."""


def _operator(target: str):
    parts = target.split(".")
    if parts[:2] != ["torch", "ops"] or len(parts) != 5:
        raise Unsupported(target)
    try:
        return getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
    except (AttributeError, RuntimeError):
        raise Unsupported(target) from None


def _value(arg: dict, env: dict, device: torch.device | None):
    ((kind, value),) = arg.items()
    if kind == "as_float":  # the schema writes non-finite floats as strings ("-Infinity", "NaN")
        return float(value)
    if kind == "as_floats":
        return [float(v) for v in value]
    if kind in _LITERALS:
        return value
    if kind == "as_none":
        return None
    if kind == "as_tensor" or kind in ("as_sym_float", "as_sym_int", "as_sym_bool"):
        name = value["name"] if kind == "as_tensor" else value.get("as_name")
        if name not in env:
            raise Unsupported(f"{kind} {value}")
        return env[name]
    if kind == "as_tensors":
        return [env[t["name"]] for t in value]
    if kind == "as_optional_tensors":
        return [None if "as_none" in t else env[t["as_tensor"]["name"]] for t in value]
    if kind == "as_scalar_type" and value in _DTYPES:
        return _DTYPES[value]
    if kind == "as_memory_format" and value in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[value]
    if kind == "as_layout" and value in _LAYOUTS:
        return _LAYOUTS[value]
    if kind == "as_device":
        # Devices baked into the trace (arange, full, ...) follow the program to its device.
        return device if device is not None else torch.device(value["type"], value.get("index"))
    raise Unsupported(kind)


# input_specs kinds of lifted tensors -> the field naming the tensor (its key in the constants file)
_LIFTED = {"buffer": "buffer_name", "parameter": "parameter_name", "tensor_constant": "tensor_constant_name"}


def _lifted_tensors(constants: bytes | None) -> dict[str, torch.Tensor]:
    """A program's constants file (runner.format.program.encode_program: keys "<table>/<name>") by name."""
    from safetensors.torch import load

    return {key.partition("/")[2]: value for key, value in (load(constants) if constants else {}).items()}


def load_graph_module(program_json: bytes, device: torch.device | None = None, constants: bytes | None = None) -> torch.fx.GraphModule | None:
    """The program as an FX GraphModule taking its user inputs positionally (its lifted tensors,
    from `constants`, held as attributes), or None if it needs torch's deserializer."""
    try:
        program = json.loads(program_json)
        module = program["graph_module"]
        signature = module["signature"]
        if any("user_output" not in s for s in signature["output_specs"]):
            raise Unsupported("mutation outputs")
        graph_json = module["graph"]
        graph = torch.fx.Graph()
        root = torch.nn.Module()
        lifted = _lifted_tensors(constants)
        env: dict = {}
        for index, (inp, spec) in enumerate(zip(graph_json["inputs"], signature["input_specs"], strict=True)):
            name = inp["as_tensor"]["name"]
            ((kind, entry),) = spec.items()
            if kind == "user_input":
                env[name] = graph.placeholder(name)
                continue
            if kind not in _LIFTED or entry[_LIFTED[kind]] not in lifted:
                raise Unsupported(f"input {name} ({kind})")
            tensor = lifted[entry[_LIFTED[kind]]]
            attribute = f"_lifted{index}"
            root.register_buffer(attribute, tensor.to(device) if device is not None else tensor)
            env[name] = graph.get_attr(attribute)
        for node in graph_json["nodes"]:
            args, kwargs = [], {}
            for inp in node["inputs"]:
                value = _value(inp["arg"], env, device)
                if inp["kind"] == 1:
                    args.append(value)
                else:
                    kwargs[inp["name"]] = value
            call = graph.call_function(_operator(node["target"]), tuple(args), kwargs)
            outputs = node["outputs"]
            if len(outputs) == 1 and "as_tensors" not in outputs[0]:
                ((kind, value),) = outputs[0].items()
                if kind != "as_none":
                    env[value["name"] if kind == "as_tensor" else value["as_name"]] = call
            else:
                listed = outputs[0]["as_tensors"] if len(outputs) == 1 else [o.get("as_tensor") for o in outputs]
                for index, out in enumerate(listed):
                    if out is not None:
                        env[out["name"]] = graph.call_function(operator.getitem, (call, index))
        graph.output(tuple(env[o["as_tensor"]["name"]] for o in graph_json["outputs"]))
        return torch.fx.GraphModule(root, graph)
    except (Unsupported, KeyError, TypeError, ValueError):
        return None


def input_shapes(program_json: bytes) -> list[list[int] | None] | None:
    """The shape each input of a program was traced for (None where it is symbolic or not a
    tensor), or None if the program does not say."""
    try:
        graph = json.loads(program_json)["graph_module"]["graph"]
        values = graph["tensor_values"]
        shapes = []
        for inp in graph["inputs"]:
            sizes = values[inp["as_tensor"]["name"]]["sizes"] if "as_tensor" in inp else None
            shapes.append([d["as_int"] for d in sizes] if sizes is not None and all("as_int" in d for d in sizes) else None)
        return shapes
    except (KeyError, TypeError, ValueError):
        return None


# -- gloo: one collective in flight at a time ---------------------------------------------------
_FUNCOL = "_c10d_functional"


def _is_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops._c10d_functional.wait_tensor.default


def is_collective(node: torch.fx.Node) -> bool:
    """A functional collective's issue (all_gather_into_tensor, reduce_scatter_tensor, all_reduce,
    ...): a call into torch.ops._c10d_functional other than wait_tensor and the point-to-point
    transfers of pipeline stages (runner/execution/p2p.py), whose waits must stay where the build put them:
    waiting for a send at its issue would block until the peer receives, and the peer may be
    waiting for this rank."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == _FUNCOL
        and not _is_wait(node)
        and not is_point_to_point(node)
    )


def wait_at_issue(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Move every collective's wait_tensor to right after the collective, so at most one collective
    is in flight at any point of the program; returns `gm`, rewritten in place and recompiled.

    For gloo only. aot's graphs issue collectives early and wait for them late (aot.passes.overlap,
    aot.passes.prefetch), which on NCCL hides communication behind compute. On gloo it puts many
    collectives of one process group in flight at once (an FSDP step: dozens of gradient
    reduce_scatters plus parameter all_gathers), and ProcessGroupGloo then runs them concurrently
    on its worker threads over one gloo context. With torch 2.13 that corrupts the heap or loses
    a message, about once per few hundred steps ("malloc(): unaligned tcache chunk detected",
    segfaults, "Timed out waiting for send operation"); a bare two-rank script of functional
    collectives shows it with inputs kept alive too, and not with each collective waited at once
    or with a single gloo worker thread. Waiting at issue costs nothing the plan counted on: the
    planner prices gloo collectives as not overlapping compute (aot.plan.search, `overlaps`).

    A wait depends on its collective's result alone, so moving it up to the collective (with the
    getitem that picks a coalesced collective's piece) never breaks an input-before-use order."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not is_collective(node):
            continue
        anchor = node
        for user in list(node.users):
            if _is_wait(user):
                chain = [user]
            elif user.op == "call_function" and user.target is operator.getitem:  # a coalesced collective's piece
                chain = [user, *(w for w in user.users if _is_wait(w))]
            else:
                continue
            for moved in chain:
                if anchor.next is not moved:
                    anchor.append(moved)
                anchor = moved
    graph.lint()
    gm.recompile()
    return gm


def most_in_flight(graph: torch.fx.Graph) -> int:
    """The most collectives issued and not yet waited for at any point of `graph`."""
    outstanding: set = set()
    most = 0
    for node in graph.nodes:
        if is_collective(node):
            outstanding.add(node)
            most = max(most, len(outstanding))
        elif _is_wait(node):
            source = node.args[0]
            if source.op == "call_function" and source.target is operator.getitem:
                source = source.args[0]
            outstanding.discard(source)
    return most


def load_portable(artifact, program: dict, device: torch.device, program_json: bytes | None = None) -> tuple[torch.fx.GraphModule, str]:
    """(module, how it was loaded) of the artifact's portable `program` (its manifest entry) on
    `device`: this module's fast path ("fx"), else torch's deserializer ("torch.export")."""
    from runner.format.program import decode_program

    program_json = program_json if program_json is not None else artifact.read(program["file"])
    constants = artifact.read(program["constants"]) if program.get("constants") else None
    module = load_graph_module(program_json, device if device.type != "cpu" else None, constants)
    if module is not None:
        return module, "fx"
    ep = decode_program(program_json, constants)  # a program the fast path does not cover
    if device.type != "cpu":
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, device)
    module = ep.module()
    assert isinstance(module, torch.fx.GraphModule)  # what torch.export's module() makes
    return module, "torch.export"


def uses_batch(module: torch.fx.GraphModule, slots: list[dict]) -> bool:
    """Whether the program reads any tensor of the batch (an input or the targets): a placeholder
    of theirs with users. Placeholders come in the order of the manifest's inputs (`slots`)."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(slots):  # not the flat program this module loads: assume it does
        return True
    return any(node.users for node, slot in zip(placeholders, slots) if slot["kind"] in ("input", "target"))
