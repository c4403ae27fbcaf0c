"""Inference export: the model's forward as ONNX, its weights left out, checked with ONNX Runtime.

`aot build` never has the model's weights: `state.model` holds fake tensors, and the artifact
ships an init program instead (runner/execution/init_program.py). So the forward is exported as a graph
only, into the artifact (`inference/model.onnx`, described by the manifest's `inference` entry),
and the runner attaches the weights when it runs it; `aot export --checkpoint` attaches a
checkpoint's trained weights and writes a standalone file. The steps:

1. the model (fake or real tensors) in eval mode is exported with `torch.export` (dynamic batch
   dimension named `batch`) and translated by `torch.onnx.export(..., dynamo=True)`; custom
   operators go through the model file's `onnx_translations` (operator -> onnxscript function),
   and an operator without one stops the export with a line saying so;
2. every parameter and buffer the graph reads becomes an ONNX initializer that holds no data:
   an external-data reference into `WEIGHTS_LOCATION` (a file that is never written), with its
   name, dtype and shape. The manifest's `initializers` maps each to its parameter or buffer
   (the manifest's `state` names: a tied weight's initializer may carry another of its names).
   torch.onnx's optimizer runs with the weights' values hidden, so it folds nothing into them
   and their names survive. A tensor the forward reads that is neither a parameter nor a buffer
   (a plain tensor attribute) has no values at build time and is refused;
3. `onnx.checker` checks the model (the weights as graph inputs, since their data is absent);
   per-node debug metadata (source paths, stack traces) is dropped so equal models give equal
   bytes;
4. when the weights fit `CHECK_BUDGET_BYTES`, they are made for real (by the caller: the init
   program's replay, or a checkpoint) and ONNX Runtime (CPU), given them in memory, runs the
   example batch and a batch of one; the largest difference from eager PyTorch on the same
   weights (the fake-tensor model called with them through `torch.func.functional_call`) must be
   within `TOLERANCE`. Above the budget the check is skipped: `max_abs_diff` is null, `unchecked`
   says why, and the build prints one warning line.

Inputs are named as in --data files (`inputs`, or `inputs.0`, `inputs.1`, ...), so an example
batch or data file feeds `aot infer` directly; outputs are `outputs` (or `outputs.0`, ...).
The files are protobuf (no pickles). Writing an export with weights attached (`aot export`) is
aot/emit/onnx_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

import runner
from aot.capture.custom_ops import custom_ops_in
from aot.capture.model_file import ModelFile, call_user
from aot.errors import AotError
from runner.execution.data import dtype_name

ONNX_FILE = "inference/model.onnx"
WEIGHTS_LOCATION = "model.onnx.data"  # what the artifact's ONNX names as its weights' file; never written
TOLERANCE = 1e-4
BATCH_DIM = "batch"
CHECK_BUDGET_BYTES = 2**30  # the numeric check makes the weights for real only up to this size
_ALIGN = 64  # byte alignment of each weight in an external-data file

Weights = Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]


class OnnxUnsupported(AotError):
    """The model cannot be exported to ONNX (or its export does not match eager PyTorch)."""


@dataclass
class OnnxExport:
    data: bytes  # the .onnx file, weights left out (external-data references to WEIGHTS_LOCATION)
    spec: dict  # the manifest's `inference` entry, less `file`

    def weights_for(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ONNX initializer name -> tensor, from tensors named as the model's parameters and buffers."""
        missing = [state for state in self.spec["initializers"].values() if state not in tensors]
        if missing:
            raise AotError(f"no tensor for {missing[0]!r}, which the ONNX graph reads")
        return {name: tensors[state] for name, state in self.spec["initializers"].items()}


def io_names(prefix: str, count: int) -> list[str]:
    return [prefix] if count == 1 else [f"{prefix}.{i}" for i in range(count)]


def translation_table(mf: ModelFile) -> dict:
    """The model file's `onnx_translations` as {OpOverload: function}. Keys may be an OpOverload
    (`torch.ops.ns.op.default`), its packet (`torch.ops.ns.op`), the object `torch.library.custom_op`
    returns, or the name `"ns::op"`."""
    table = mf.onnx_translations
    if table is None:
        return {}
    if not isinstance(table, dict):
        table = call_user(table, "onnx_translations()", mf.path)
        if not isinstance(table, dict):
            raise AotError(f"{mf.path.name}: onnx_translations() must return a dict, got {type(table).__name__}")
    result = {}
    for key, fn in table.items():
        op = key
        if isinstance(op, str) and "::" in op:
            namespace, _, name = op.partition("::")
            op = getattr(getattr(torch.ops, namespace), name, None)
        op = getattr(op, "_opoverload", op)  # torch.library.custom_op's CustomOpDef
        if isinstance(op, torch._ops.OpOverloadPacket):
            op = op.default
        if not isinstance(op, torch._ops.OpOverload):
            raise AotError(f"{mf.path.name}: onnx_translations key {key!r} is not a torch operator (use torch.ops.<namespace>.<name>.default)")
        if not callable(fn):
            raise AotError(f"{mf.path.name}: onnx_translations[{key!r}] must be a function (an onnxscript translation)")
        result[op] = fn
    return result


def export_inputs(mf: ModelFile, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Example inputs for the export: a dynamic batch dimension needs at least 2 samples to trace
    (torch specializes sizes 0 and 1), so a batch of one is replaced by batch(2)'s inputs."""
    if inputs[0].shape[0] >= 2:
        return inputs
    result = call_user(mf.batch, "batch(2)", mf.path, 2)
    more = result[0]
    return [more] if isinstance(more, torch.Tensor) else list(more)


@contextlib.contextmanager
def _quiet():
    """torch.onnx prints progress, warns about torchvision and deprecations, onnx_ir about the
    weights' hidden values: none of it is the user's."""
    loggers = [
        logging.getLogger(n)
        for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript", "onnx_ir", "torch.fx.experimental.symbolic_shapes", "torch._dynamo")
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    # torch.onnx wraps the cause in a long report; its summary names the failing operator
    for line in text.splitlines():
        if "No ONNX function found" in line or line.startswith("<class '"):
            return re.sub(r"^<class '[\w.]+\.(\w+)'>: ", r"\1: ", line)[:400]
    return (text.splitlines()[0] if text else type(e).__name__)[:400]


def _strip_debug_metadata(graph) -> None:
    for node in graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
        for attr in node.attribute:
            if attr.g is not None and attr.HasField("g"):
                _strip_debug_metadata(attr.g)
            for sub in attr.graphs:
                _strip_debug_metadata(sub)


def _rename_dim(proto, old: str, new: str) -> None:
    """Give a symbolic dimension its name (torch.onnx keeps torch's symbol, such as `s31`)."""
    graphs = [proto.graph]
    for graph in graphs:
        for value in [*graph.input, *graph.output, *graph.value_info]:
            for dim in value.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and dim.dim_param == old:
                    dim.dim_param = new
        graphs.extend(a.g for n in graph.node for a in n.attribute if a.HasField("g"))
        graphs.extend(g for n in graph.node for a in n.attribute for g in a.graphs)


def _dims(value_info) -> list:
    return [d.dim_param if d.HasField("dim_param") else int(d.dim_value) for d in value_info.type.tensor_type.shape.dim]


def _max_diff(eager: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    worst = 0.0
    for e, g in zip(eager, got, strict=True):
        if list(e.shape) != list(g.shape):
            return float("inf")
        if e.numel():
            worst = max(worst, (e.detach().double() - g.double()).abs().max().item())
    return worst


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters then buffers under their canonical names (a tied tensor once, under
    its first name), as the manifest's `state` and the init program's outputs name them."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every name of a parameter or buffer (tied ones under each name) -> its canonical name."""
    first: dict[int, str] = {}
    result = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        result[name] = first.setdefault(id(t), name)
    return result


def _is_real(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor) and not t.is_meta


def has_real_weights(model: torch.nn.Module) -> bool:
    return all(_is_real(t) for t in state_tensors(model).values())


def init_program_weights(init, names: list[str], seed: int) -> Callable[[], dict[str, torch.Tensor]]:
    """The initial weights as the runner makes them, made only when called: the init program
    replayed after `torch.manual_seed(seed)` (runner/execution/init_program.py). `init`: the build's traced
    graph (`TrainingState.init_graph`), or the init program as an ExportedProgram, which is then
    encoded as the artifact stores it and decoded first. `names`: its outputs, params then buffers."""

    def make() -> dict[str, torch.Tensor]:
        from runner.execution.init_program import load_init_graph, replay

        graph = init
        if isinstance(init, torch.export.ExportedProgram):
            from runner.format.program import encode_program

            graph = load_init_graph(*encode_program(init))
        return replay(graph, list(names), seed)

    return make


def recorded_weights(mf: ModelFile, names: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """Real weights for a model the caller has only on fake tensors and without its init program:
    `model()`'s construction recorded again (make_fx on fake tensors, as `aot build` records it)
    and replayed after `torch.manual_seed(seed)`. The numeric check needs real weights of the
    model's kind (norm scales of one, causal masks), not the build's seed."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from runner.execution.init_program import replay

    def construct():
        model = call_user(mf.model, "model()", mf.path)
        return list(state_tensors(model).values())

    with torch.no_grad(), _quiet():
        graph = make_fx(construct, tracing_mode="fake")()
    return replay(graph, list(names), seed)


# -- the export ----------------------------------------------------------------------------------


def _export_graph(mf: ModelFile, model: torch.nn.Module, inputs: list[torch.Tensor], metadata: dict[str, str]):
    """(the weight-less ONNX model as a ModelProto, the spec less the check's fields)."""
    where = mf.path.name
    input_names = io_names("inputs", len(inputs))
    table = translation_table(mf)
    batch = torch.export.Dim(BATCH_DIM)
    with torch.no_grad():
        try:
            with _quiet():
                ep = torch.export.export(model, tuple(inputs), dynamic_shapes=tuple({0: batch} for _ in inputs), strict=False)
        except Exception as e:
            raise OnnxUnsupported(f"the forward cannot be exported with a dynamic batch dimension: {_first_line(e)}") from e
    sig = ep.graph_signature
    user_outputs = [s for s in sig.output_specs if s.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT]
    nodes = {n.name: n for n in ep.graph.nodes}
    out_dtypes = []
    for s in user_outputs:
        val = nodes[s.arg.name].meta.get("val") if isinstance(s.arg, torch.export.graph_signature.TensorArgument) else None
        if not isinstance(val, torch.Tensor):
            kind = type(getattr(s.arg, "value", s.arg)).__name__
            raise OnnxUnsupported(f"the forward returns a {kind}; only tensors can be exported")
        out_dtypes.append(val.dtype)
    output_names = io_names("outputs", len(user_outputs))
    translated = {op._schema.name for op in table}
    ops = custom_ops_in(ep.graph)
    missing = [op for op in ops if op not in translated]
    if missing:
        raise OnnxUnsupported(f"custom operator {missing[0]} has no ONNX translation; give one in {where}'s onnx_translations (see examples/custom_op.py)")
    try:
        with _quiet():
            program = torch.onnx.export(
                ep,
                tuple(inputs),
                dynamo=True,
                input_names=input_names,
                output_names=output_names,
                custom_translation_table=table or None,
                external_data=False,
                optimize=False,
                verbose=False,
                report=False,
            )
    except Exception as e:
        raise OnnxUnsupported(f"torch.onnx.export failed: {_first_line(e)}") from e
    assert program is not None  # dynamo=True returns the ONNXProgram (None is the legacy exporter's)

    import onnx
    import onnx_ir as ir

    graph = program.model.graph
    canonical = _canonical_names(model)
    stored = {*sig.inputs_to_parameters.values(), *sig.inputs_to_buffers.values()}
    weights: dict[ir.Value, tuple[str, int, ir.DataType, ir.Shape]] = {}  # (state name, byte length, dtype, shape)
    for name, value in list(graph.initializers.items()):
        const = value.const_value
        tensor = getattr(const, "raw", None)
        if const is not None and name in stored and name in canonical and isinstance(tensor, torch.Tensor):
            assert isinstance(const.shape, ir.Shape)  # the exporter's tensors are onnx_ir's own
            weights[value] = (canonical[name], _nbytes(tensor), const.dtype, const.shape)
            value.const_value = None  # hidden from the optimizer: nothing is folded into a weight
        elif not _is_real(tensor):
            raise OnnxUnsupported(
                f"the forward reads tensor attribute {name!r}, which is neither a parameter nor a "
                f"buffer, so the build does not have its values; register it in {where} with "
                f"register_buffer({name.rpartition('.')[2]!r}, ..., persistent=False)"
            )
    try:
        with _quiet():
            program.optimize()
    except Exception as e:
        raise OnnxUnsupported(f"optimizing the ONNX graph failed: {_first_line(e)}") from e
    initializers, offset = {}, 0
    for value in graph.initializers.values():
        if value.const_value is not None:
            continue
        if value not in weights:
            raise OnnxUnsupported(f"the ONNX graph has an initializer {value.name!r} without values that is no parameter or buffer of the model")
        state, length, dtype, shape = weights[value]
        assert value.name is not None  # ir.Graph keys its initializers by their names
        value.const_value = ir.ExternalTensor(WEIGHTS_LOCATION, offset, length, dtype, shape=shape, name=value.name)
        initializers[value.name] = state
        offset += _aligned(length)
    proto = program.model_proto
    first = proto.graph.input[0].type.tensor_type.shape.dim[0]
    if not first.HasField("dim_param"):
        raise OnnxUnsupported("the export fixed the batch dimension; the forward must accept any batch size")
    _rename_dim(proto, first.dim_param, BATCH_DIM)
    _strip_debug_metadata(proto.graph)
    for function in proto.functions:
        for node in function.node:
            del node.metadata_props[:]
    del proto.metadata_props[:]
    for key, text in {"aot.version": runner.__version__, "aot.model_sha256": mf.sha256, **metadata}.items():
        proto.metadata_props.add(key=key, value=text)
    try:
        onnx.checker.check_model(_without_weights(proto), full_check=True)
    except Exception as e:
        raise OnnxUnsupported(f"onnx.checker refuses the exported model: {_first_line(e)}") from e
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    graph_inputs = {v.name: v for v in proto.graph.input}
    graph_outputs = {v.name: v for v in proto.graph.output}
    spec = {
        "format": "onnx",
        "opset": opset,
        "batch_dim": BATCH_DIM,
        "inputs": [{"name": n, "shape": _dims(graph_inputs[n]), "dtype": dtype_name(t.dtype)} for n, t in zip(input_names, inputs)],
        "outputs": [{"name": n, "shape": _dims(graph_outputs[n]), "dtype": dtype_name(d)} for n, d in zip(output_names, out_dtypes)],
        "custom_ops": sorted(op for op in ops),
        "initializers": initializers,
        "weights_bytes": sum(_nbytes(t) for t in state_tensors(model).values()),
    }
    return proto, spec


def _without_weights(proto):
    """A copy of `proto` whose weights (external-data initializers) are graph inputs instead, for
    onnx.checker: it would look for their data file, which an artifact does not have."""
    import onnx

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    external = [t for t in probe.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    kept = [t for t in probe.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    del probe.graph.initializer[:]
    probe.graph.initializer.extend(kept)
    probe.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    return probe


def _numeric_check(
    mf: ModelFile,
    model: torch.nn.Module,
    inputs: list[torch.Tensor],
    spec: dict,
    session,
    weights: Mapping[str, torch.Tensor],
    *,
    tolerance_for: Callable | None = None,
    runtime: str = "ONNX Runtime",
) -> tuple[float, float]:
    """(largest |ONNX Runtime - eager PyTorch| over `inputs` and their first sample, the tolerance
    it was held to), eager being `model` called with `weights` (state names) in eval mode;
    OnnxUnsupported beyond the tolerance. `session`: anything with ONNX Runtime's
    `run(output_names, feeds)`, named by `runtime` (onnx's reference evaluator for bf16).
    The tolerance is TOLERANCE, or `tolerance_for(eager outputs, feeds)` for each batch (a
    reduced-precision export's, aot/emit/onnx_checkpoint.py), which compares floating outputs only:
    an argmax may flip where rounding ties two values."""
    input_names = [i["name"] for i in spec["inputs"]]
    output_names = [o["name"] for o in spec["outputs"]]
    was_training = model.training
    model.eval()

    def forward(*args):
        return torch.func.functional_call(model, dict(weights), args)

    checks = []  # (|difference|, tolerance) per batch
    try:
        for feeds in (inputs, [t[:1] for t in inputs]):
            with torch.no_grad():
                eager = torch.utils._pytree.tree_leaves(call_user(forward, "the model's forward (eval mode)", mf.path, *feeds))
            got = session.run(output_names, {n: t.detach().contiguous().numpy() for n, t in zip(input_names, feeds)})
            got = [torch.from_numpy(g) for g in got]
            if tolerance_for is None:
                checks.append((_max_diff(eager, got), TOLERANCE))
            else:
                kept = [i for i, e in enumerate(eager) if e.is_floating_point()]
                checks.append((_max_diff([eager[i] for i in kept], [got[i] for i in kept]), tolerance_for(eager, feeds)))
    finally:
        model.train(was_training)
    worst, tolerance = max(checks, key=lambda c: c[0] / c[1] if c[0] == c[0] else float("inf"))  # NaN is the worst
    if not worst <= tolerance:
        raise OnnxUnsupported(f"{runtime} differs from eager PyTorch by {worst:.3g} on the example batch (tolerance {tolerance:.3g})")
    return worst, tolerance


def _unchecked(spec: dict, reason: str) -> None:
    spec.update({"max_abs_diff": None, "tolerance": TOLERANCE, "checked_batch_sizes": [], "unchecked": reason})


def _budget_reason(size: int) -> str:
    return f"the weights ({size / 2**30:.1f} GiB) exceed the numeric check's budget of {CHECK_BUDGET_BYTES / 2**30:.1f} GiB"


def export_onnx(
    mf: ModelFile,
    model: torch.nn.Module,
    inputs: list[torch.Tensor],
    *,
    weights: Weights | None = None,
    metadata: dict[str, str] | None = None,
    check: bool = True,
    warn: Callable[[str], None] = lambda msg: None,
) -> OnnxExport:
    """Export `model`'s forward (eval mode) to ONNX without its weights and check it; OnnxUnsupported
    says why not. `model` may hold fake tensors (as `aot build` has it); the check then takes
    `weights` (the model's parameter and buffer names -> real tensors, or a function making them,
    called only when they fit CHECK_BUDGET_BYTES). A model with real tensors is checked on its own;
    one with fake tensors and no `weights` on its construction recorded again and replayed
    (`recorded_weights`). A skipped check is one line through `warn` and `unchecked` in the spec."""
    inputs = export_inputs(mf, inputs)
    was_training = model.training
    model.eval()
    try:
        proto, spec = _export_graph(mf, model, inputs, metadata or {})
    finally:
        model.train(was_training)
    data = proto.SerializeToString()
    if not check:
        return OnnxExport(data=data, spec=spec)
    size = spec["weights_bytes"]
    if weights is None and has_real_weights(model):
        weights = state_tensors(model)
    if size > CHECK_BUDGET_BYTES:
        _unchecked(spec, _budget_reason(size))
    else:
        if weights is None:
            weights = functools.partial(recorded_weights, mf, list(state_tensors(model)))
        real = dict(weights() if callable(weights) else weights)
        from runner.execution.infer import create_session

        session, _ = create_session(data, "cpu", initializers=OnnxExport(data, spec).weights_for(real), where="the exported model")
        worst, tolerance = _numeric_check(mf, model, inputs, spec, session, real)
        spec.update({"max_abs_diff": worst, "tolerance": tolerance, "checked_batch_sizes": [int(inputs[0].shape[0]), 1]})
    if spec.get("unchecked"):
        warn(f"{mf.path.name}: the ONNX export was not checked against eager PyTorch: {spec['unchecked']}")
    return OnnxExport(data=data, spec=spec)


def build_inference(
    mf: ModelFile, model: torch.nn.Module, inputs: list[torch.Tensor], *, required: bool, warn, weights: Weights | None = None
) -> OnnxExport | None:
    """`aot build`'s ONNX stage: the export, or None with one warning line when the model cannot
    be exported and the user did not ask for ONNX explicitly (`--onnx` makes it an error).
    `weights`: the initial weights for the numeric check (`init_program_weights(...)`); `model` may be
    the build's fake-tensor model."""
    try:
        return export_onnx(mf, model, inputs, weights=weights, metadata={"aot.weights": "initial"}, warn=warn)
    except OnnxUnsupported as e:
        if required:
            raise OnnxUnsupported(f"{mf.path.name}: no ONNX export: {e}") from e
        warn(f"{mf.path.name}: building without an ONNX inference export: {e} (--onnx makes this an error, --no-onnx skips the export)")
        return None


def _fake_model(mf: ModelFile) -> torch.nn.Module:
    """`model()` on fake tensors: its structure and forward, no weight memory (as `aot build`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        model = call_user(mf.model, "model()", mf.path)
    if not isinstance(model, torch.nn.Module):
        raise AotError(f"{mf.path.name}: model() must return a torch.nn.Module, got {type(model).__name__}")
    return model
